"""MetricsLogger: read back with TensorBoard's own EventAccumulator and the JSONL; failing sinks; percentiles.

    python -m pytest tests/unit/test_metrics.py -q
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from megatron_rl.metrics import MetricsLogger, percentiles

pytestmark = pytest.mark.unit


def test_logs_reach_tensorboard_and_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        log.log(0, {"learn/loss": 0.5, "queue/depth": 3, "numerics/grad_norm": torch.tensor(2.25)})
        log.log(1, {"learn/loss": 0.25, "system/gpu_mem_gb": np.float32(1.5), "latency/step_s": True})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"learn/loss", "queue/depth", "numerics/grad_norm", "system/gpu_mem_gb",
                                         "latency/step_s"}
    assert [(e.step, e.value) for e in acc.Scalars("learn/loss")] == [(0, 0.5), (1, 0.25)]
    assert acc.Scalars("numerics/grad_norm")[0].value == pytest.approx(2.25)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["queue/depth"] == 3.0 and rows[1]["system/gpu_mem_gb"] == 1.5 and rows[1]["latency/step_s"] == 1.0


def test_keys_need_a_known_panel(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="'loss' needs a panel prefix"):
            log.log(0, {"learn/ok": 1.0, "loss": 1.0})
        with pytest.raises(ValueError, match="'training/loss'"):
            log.log(0, {"training/loss": 1.0})
        with pytest.raises(ValueError, match="'learn/x': value must be a real number"):
            log.log(0, {"learn/x": "high"})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing half-written


class _BrokenSink:
    name = "broken"

    def write(self, step, wall_time, scalars):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_failing_sink_is_logged_and_others_continue(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_rl.metrics"):
        with MetricsLogger(tmp_path, tensorboard=False, sinks=[_BrokenSink()]) as log:
            for step in range(3):
                log.log(step, {"learn/loss": float(step)})
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3
    assert log.failures["broken"] == 6  # 3 writes + 3 flushes
    assert any("No space left" in r.message for r in caplog.records)


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    got = percentiles(values, "latency/rollout_s")
    want = np.percentile(values, [50, 95, 99])
    assert list(got) == ["latency/rollout_s/p50", "latency/rollout_s/p95", "latency/rollout_s/p99"]
    assert list(got.values()) == pytest.approx(want.tolist())
    assert percentiles([], "latency/x") == {}
    assert percentiles([4.0], "latency/x", qs=(50,)) == {"latency/x/p50": 4.0}
    with pytest.raises(ValueError, match="150"):
        percentiles([1.0], "latency/x", qs=(150,))
