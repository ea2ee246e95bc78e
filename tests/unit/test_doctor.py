"""`megatron-rl doctor`: each runbook leaf fires on a synthetic metric history that shows its
symptom (and names the metric, step and value), a healthy history and a real tiny run's
metrics raise nothing, and the CLI exits 0 healthy / 1 findings / 2 no metrics.

    python -m pytest tests/unit/test_doctor.py -q
"""

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.doctor import diagnose

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
REAL = DATA / "tiny_cpu_3steps_metrics.jsonl"  # megatron-rl train, configs/tiny_cpu.yaml, run.steps=3
REAL_12 = DATA / "tiny_cpu_12steps_metrics.jsonl"  # the same with run.steps=12 run.eval_every=4
STEPS = 20


def healthy_row(step):
    """A learning run: reward and correctness rise, everything else in range."""
    return {"step": step, "time": 1000.0 + step, "learn/reward_mean": 0.1 + 0.03 * step,
            "learn/reward_format": 0.1 + 0.02 * step, "learn/reward_correctness": 0.01 * step,
            "learn/zero_variance_groups": 1.0, "learn/d_lag/p95": 1e-6, "learn/clip_fraction": 0.01,
            "learn/kl_ref_k2_grad_theta_ref": 0.01 * step, "learn/entropy_estimate": 3.0 - 0.02 * step,
            "numerics/nonfinite_loss": 0.0, "numerics/nonfinite_grad_norm": 0.0,
            "latency/verifier_scored": 64.0 * step, "latency/verifier_timeout": 0.0, "latency/verifier_crash": 0.0,
            "latency/verifier_grader_error": 0.0, "latency/verifier_error_rate": 0.0,
            "queue/version": float(step), "queue/backpressure": 0.0, "queue/leases_expired": 0.0,
            "queue/conflicts": 0.0, "system/esr": 0.8, "system/time_step_s": 1.0}


def make_run(tmp_path, edit=None, *, steps=STEPS, config=None, checkpoint=True, final_eval=True):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    rows = [{"step": 0, "time": 1000.0, "eval/test_reward": 0.0, "eval/test_verifier_errors": 0.0}]
    for step in range(1, steps + 1):
        row = healthy_row(step)
        if edit:
            edit(step, row)
        rows.append(row)
    if final_eval:
        rows.append({"step": steps, "time": 2000.0, "eval/test_reward": 0.5, "eval/test_verifier_errors": 0.0})
    (run / "metrics" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"run": {"steps": steps, "prompts_per_step": 8, "checkpoint_every": 0}, "stop": {}, "coordinator": {}}
    for section, values in (config or {}).items():
        cfg[section].update(values)
    (run / "config.json").write_text(json.dumps(cfg))
    if checkpoint:
        ck = run / "checkpoints" / f"step_{steps:06d}"
        ck.mkdir(parents=True)
        (ck / "COMMITTED").write_text(json.dumps({"step": steps}))
    return run


def leaves(report):
    return {f["leaf"] for f in report["findings"]}


def only(report, leaf):
    assert leaves(report) == {leaf}, report["findings"]
    return [f for f in report["findings"] if f["leaf"] == leaf]


def test_healthy_synthetic_run_has_no_findings(tmp_path):
    report = diagnose(make_run(tmp_path))
    assert report["healthy"] and report["findings"] == [] and report["steps"] == STEPS


def test_real_tiny_run_raises_no_false_alarm(tmp_path):
    run = tmp_path / "real"
    (run / "metrics").mkdir(parents=True)
    shutil.copy(REAL, run / "metrics" / "metrics.jsonl")
    (run / "config.json").write_text(json.dumps({"run": {"steps": 3, "prompts_per_step": 8, "checkpoint_every": 0}}))
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "COMMITTED").write_text("{}")
    report = diagnose(run)
    assert report["healthy"], report["findings"]
    assert report["steps"] == 3


def test_real_12_step_run_findings_are_the_true_ones(tmp_path):
    """From step 5 the tiny policy answers in format but never correctly: every group has one
    reward (learn/zero_variance_groups = 8 of 8) and system/esr is 0, so those two leaves fire;
    reward rises and correctness moves at the end, so the trend leaves stay quiet."""
    run = tmp_path / "real12"
    (run / "metrics").mkdir(parents=True)
    shutil.copy(REAL_12, run / "metrics" / "metrics.jsonl")
    (run / "config.json").write_text(json.dumps({"run": {"steps": 12, "prompts_per_step": 8, "checkpoint_every": 4}}))
    for step in (8, 12):
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "COMMITTED").write_text("{}")
    report = diagnose(run)
    assert leaves(report) == {"zero-variance-groups", "throughput"}, report["findings"]
    assert {f["metric"] for f in report["findings"]} == {"learn/zero_variance_groups", "system/esr"}


def test_nonfinite(tmp_path):
    def edit(step, row):
        row["numerics/nonfinite_grad_norm"] = float(step >= 7)
    (f,) = only(diagnose(make_run(tmp_path, edit)), "nonfinite")
    assert (f["metric"], f["step"], f["value"]) == ("numerics/nonfinite_grad_norm", 7, 1.0)


def test_reward_flat(tmp_path):
    def edit(step, row):
        row["learn/reward_mean"] = 0.2 + 0.001 * (step % 2)
        row["learn/reward_format"] = row["learn/reward_correctness"] = 0.1
    (f,) = only(diagnose(make_run(tmp_path, edit)), "reward-flat")
    assert f["metric"] == "learn/reward_mean" and f["step"] == STEPS


def test_format_rises_but_correctness_flat(tmp_path):
    def edit(step, row):
        row["learn/reward_correctness"] = 0.02
    (f,) = only(diagnose(make_run(tmp_path, edit)), "format-not-correctness")
    assert f["metric"] == "learn/reward_correctness" and f["value"] == pytest.approx(0.02)


def test_zero_variance_groups(tmp_path):
    def edit(step, row):
        row["learn/zero_variance_groups"] = 6.0 if step > 8 else 1.0
    (f,) = only(diagnose(make_run(tmp_path, edit)), "zero-variance-groups")
    assert f["metric"] == "learn/zero_variance_groups" and "75%" in f["summary"]


def test_lag_rising_over_the_configured_limit(tmp_path):
    def edit(step, row):
        row["learn/d_lag/p95"] = 0.001 * step
    assert diagnose(make_run(tmp_path, edit))["healthy"]  # under the default 0.05
    (f,) = only(diagnose(make_run(tmp_path / "b", edit, config={"stop": {"d_lag_p95_max": 0.0105}})), "lag-rising")
    assert (f["metric"], f["step"]) == ("learn/d_lag/p95", 11)


def test_lag_backpressure_most_of_the_time(tmp_path):
    def edit(step, row):
        row["queue/backpressure"] = float(step > 12)
    (f,) = only(diagnose(make_run(tmp_path, edit)), "lag-rising")
    assert f["metric"] == "queue/backpressure"


def test_clip_fraction_high(tmp_path):
    def edit(step, row):
        row["learn/clip_fraction"] = 0.4
    (f,) = only(diagnose(make_run(tmp_path, edit)), "clip-fraction-high")
    assert f["value"] == 0.4


def test_kl_exploding(tmp_path):
    def edit(step, row):
        row["learn/kl_ref_k3_grad_ref_theta"] = 2.0 ** step / 1000
        del row["learn/kl_ref_k2_grad_theta_ref"]
    (f,) = only(diagnose(make_run(tmp_path, edit)), "kl-exploding")
    assert (f["metric"], f["step"]) == ("learn/kl_ref_k3_grad_ref_theta", 14)  # 16.4 > 10


def test_entropy_collapse(tmp_path):
    def edit(step, row):
        row["learn/entropy_estimate"] = 3.0 * 0.7 ** step
    (f,) = only(diagnose(make_run(tmp_path, edit)), "entropy-collapse")
    assert f["metric"] == "learn/entropy_estimate" and f["value"] < 0.1


def test_verifier_errors(tmp_path):
    def edit(step, row):
        row["latency/verifier_timeout"] = float(step)
    (f,) = only(diagnose(make_run(tmp_path, edit)), "verifier-errors")
    assert (f["metric"], f["step"], f["value"]) == ("latency/verifier_timeout", STEPS, STEPS)


def test_queue_drops(tmp_path):
    def edit(step, row):
        row["queue/dropped/version_lag"] = float(max(0, step - 15))
    (f,) = only(diagnose(make_run(tmp_path, edit)), "queue-drops")
    assert f["metric"] == "queue/dropped/version_lag" and f["value"] == 5 and "first at step 16" in f["summary"]


def test_throughput_low_esr_and_growing_step_time(tmp_path):
    def edit(step, row):
        row["system/esr"] = 0.1
        row["system/time_step_s"] = 1.0 + step
    found = only(diagnose(make_run(tmp_path, edit)), "throughput")
    assert {f["metric"] for f in found} == {"system/esr", "system/time_step_s"}


def test_publication_refused_version_mismatch_and_early_end(tmp_path):
    def edit(step, row):
        row["queue/version"] = float(min(step, 9))
    (f,) = only(diagnose(make_run(tmp_path, edit)), "publication-refused")
    assert (f["metric"], f["step"], f["value"]) == ("queue/version", 10, 9.0)
    ended = diagnose(make_run(tmp_path / "b", steps=12, final_eval=False,
                              config={"run": {"steps": 30}}))
    (f,) = only(ended, "publication-refused")
    assert f["step"] == 12 and "step 12 of 30" in f["summary"]


def test_stopped_run_names_its_condition_and_leaf(tmp_path):
    def edit(step, row):
        row["learn/kl_ref_k2_grad_theta_ref"] = 0.5
    run = make_run(tmp_path, edit, steps=12, final_eval=False, config={"run": {"steps": 30}, "stop": {"kl_max": 0.4}})
    (run / "stop_condition.json").write_text(json.dumps(
        {"stopped": "kl_out_of_bounds", "exit_code": 83, "step": 12, "metric": "learn/kl_ref_k2_grad_theta_ref",
         "value": 0.5, "threshold": "> 0.4"}))
    found = only(diagnose(run), "kl-exploding")  # the early end is explained: no publication-refused finding
    assert any("condition kl_out_of_bounds (exit 83)" in f["summary"] and f["step"] == 12 for f in found)
    resumed = make_run(tmp_path / "b", steps=14, config={"run": {"steps": 14}})
    (resumed / "stop_condition.json").write_text(json.dumps({"stopped": "kl_out_of_bounds", "step": 12}))
    assert diagnose(resumed)["healthy"]  # resumed past the stop: the old file is not a finding


def test_checkpoint_problems(tmp_path):
    run = make_run(tmp_path, checkpoint=False)
    (f,) = only(diagnose(run), "checkpoint-problems")
    assert "no COMMITTED checkpoint" in f["summary"]
    (run / "checkpoints" / "step_000004").mkdir(parents=True)  # a save that died before COMMITTED
    (run / "checkpoints" / ".tmp.step_000008.abc").mkdir()
    (run / "checkpoints" / "step_000002").mkdir()
    (run / "checkpoints" / "step_000002" / "COMMITTED").write_text("{}")
    run_cfg = json.loads((run / "config.json").read_text())
    run_cfg["run"]["checkpoint_every"] = 2
    (run / "config.json").write_text(json.dumps(run_cfg))
    found = only(diagnose(run), "checkpoint-problems")
    text = " ".join(f["summary"] for f in found)
    assert "step_000004 has no readable COMMITTED" in text and ".tmp.step_000008" in text
    assert "18 steps behind" in text


def test_cli_exit_codes_and_json(tmp_path, capsys):
    assert main(["doctor", str(make_run(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and "sandbox on this node: bubblewrap" in out and " runs (uid " in out

    def edit(step, row):
        row["learn/clip_fraction"] = 0.5
    bad = make_run(tmp_path / "b", edit)
    assert main(["doctor", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "[clip-fraction-high]" in out and "RUNBOOK.md#clip-fraction-high" in out and "learn/clip_fraction" in out
    assert main(["doctor", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["healthy"] is False and report["findings"][0]["leaf"] == "clip-fraction-high"
    assert report["sandbox"]["runs"] is True and report["sandbox"]["bwrap"]
    assert main(["doctor", str(tmp_path / "nowhere")]) == 2


def test_every_leaf_has_a_runbook_section():
    text = (Path(__file__).resolve().parents[2] / "RUNBOOK.md").read_text()
    for leaf in ("nonfinite", "reward-flat", "format-not-correctness", "zero-variance-groups", "lag-rising",
                 "clip-fraction-high", "kl-exploding", "entropy-collapse", "verifier-errors", "queue-drops",
                 "throughput", "publication-refused", "checkpoint-problems"):
        assert f'<a id="{leaf}"></a>' in text, leaf
