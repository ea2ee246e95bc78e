"""`megatron-rl report RUN_DIR`: a PNG per chart that has data, a summary naming what is missing.

    python -m pytest tests/unit/test_report.py -q

The run directory is written by the project's own MetricsLogger (JSONL + TensorBoard), with one
series deliberately never logged (the clip fraction) and the queue's drop counters absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.metrics import MetricsLogger, percentiles
from megatron_rl.panels import CHARTS, tensorboard_layout
from megatron_rl.report import load_series, write_report

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 5, tensorboard: bool = False) -> None:
    """A small run: every reported series except learn/clip_fraction and queue/dropped*."""
    with MetricsLogger(run_dir / "metrics", tensorboard=tensorboard) as log:
        for s in range(1, steps + 1):
            m = {"learn/reward_mean": 0.1 * s, "learn/reward_correctness": 0.05 * s, "learn/kl_ref_k2_grad_theta_ref": 1e-3 * s,
                 "learn/entropy_estimate": 2.0 - 0.1 * s, "learn/response_length": 2.0, "learn/grad_norm": 1.0 / s,
                 "system/generated_tokens_per_s": 100.0 + s, "system/effective_tokens_per_s": 50.0 + s,
                 "queue/depth": float(s % 2)}
            m.update({f"system/time_{p}_s": 0.1 * s for p in ("rollout", "score", "learn", "publish", "step")})
            m.update(percentiles([0.0, 1.0, float(s)], "queue/taken_dv"))
            m.update(percentiles([1e-7 * s, 2e-7 * s, 3e-7 * s], "learn/d_lag"))
            log.log(s, m)
        log.log(steps, {"eval/test_correctness": 0.5, "eval/dev_correctness": 0.4})


def test_report_draws_every_chart_with_data_and_names_missing_series(tmp_path):
    write_run(tmp_path)
    result = write_report(tmp_path)
    out = tmp_path / "report"
    report_charts = [c for c in CHARTS if c.in_report and not c.feature]  # a single-turn run: no env/ charts
    drawn = {Path(p).name for p in result["plots"]}
    # Clip fraction has no data at all: no PNG for it, every other chart drawn.
    assert drawn == {f"{c.slug}.png" for c in report_charts if c.title != "Clip fraction"}
    for p in result["plots"]:
        assert Path(p).read_bytes()[:8] == PNG_MAGIC and Path(p).stat().st_size > 2000
    summary = (out / "summary.md").read_text()
    assert "- missing: `learn/clip_fraction`" in summary and "- missing: `queue/dropped.*`" in summary
    assert sorted(result["missing"]) == ["Clip fraction: learn/clip_fraction", "Queue depth and drops: queue/dropped.*"]
    # P50/P95/P99 of one quantity on one chart, with their numbers in the table.
    assert "![Δv P50/P95/P99](dv_p50_p95_p99.png)" in summary
    assert "| `queue/taken_dv/p50` | 5 | 1 | 1 |" in summary
    assert "| `learn/reward_mean` | 5 | 0.1 | 0.5 | 0.1 | 0.5 |" in summary


def test_a_feature_s_charts_are_drawn_only_for_runs_that_use_it(tmp_path):
    from megatron_rl.envs.metrics import summary_metrics

    write_run(tmp_path / "single")
    assert not any("episodes" in p or "environment" in p for p in write_report(tmp_path / "single")["plots"])
    episode = {"env": "guess_number", "terminal_reason": "done", "reward": 1.0, "error": "", "turns": 3,
               "tool_calls": 1, "tool_errors": 0, "step_seconds": [0.01, 0.02]}
    with MetricsLogger(tmp_path / "multi" / "metrics") as log:
        for s in range(1, 4):
            log.log(s, summary_metrics([episode, {**episode, "terminal_reason": "max_turns", "reward": 0.0}]))
    result = write_report(tmp_path / "multi")
    env_charts = {f"{c.slug}.png" for c in CHARTS if c.feature == "env/"}
    assert len(env_charts) == 3 and env_charts <= {Path(p).name for p in result["plots"]}
    assert "| `env/terminal/max_turns` | 3 | 0.5 | 0.5 |" in (tmp_path / "multi" / "report" / "summary.md").read_text()


def test_the_occupancy_chart_needs_a_streaming_run_not_any_engine_metric(tmp_path):
    (chart,) = [c for c in CHARTS if c.feature == "system/engine_occupancy"]
    with MetricsLogger(tmp_path / "rounds" / "metrics") as log:  # a round-mode run restarts an engine
        log.log(1, {"system/engine_restarts": 1.0, "learn/reward_mean": 0.1})
    assert f"{chart.slug}.png" not in {Path(p).name for p in write_report(tmp_path / "rounds")["plots"]}
    with MetricsLogger(tmp_path / "stream" / "metrics") as log:
        for s in (1, 2):
            log.log(s, {"system/engine_occupancy": 0.5 * s, "system/engine_idle_fraction": 0.1,
                        "system/learner_idle_fraction": 0.2})
    assert f"{chart.slug}.png" in {Path(p).name for p in write_report(tmp_path / "stream")["plots"]}


def test_load_series_keeps_steps_in_order_and_skips_torn_lines(tmp_path):
    write_run(tmp_path, steps=3)
    path = tmp_path / "metrics" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 4, "learn/rew')  # a line torn by a crash
    series = load_series(path)
    assert series["learn/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert series["eval/test_correctness"] == [(3, 0.5)]


def test_report_cli(tmp_path, capsys):
    write_run(tmp_path)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "pics")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "pics" / "summary.md") in out and "missing series (2)" in out
    assert main(["report", str(tmp_path / "not_a_run")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_tensorboard_layout_groups_panels_with_percentiles_on_one_chart():
    layout = tensorboard_layout()
    assert {"learn", "numerics", "system", "latency", "queue"} <= set(layout)
    kind, tags = layout["learn"]["D_lag P50/P95/P99"]
    assert kind == "Multiline" and tags == [r"learn/d_lag/p50", r"learn/d_lag/p95", r"learn/d_lag/p99"]
