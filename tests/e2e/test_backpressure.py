"""Backpressure on staleness in a real async run: the learner's D_lag P95 report throttles
admission, so the producer stops sampling ahead and later rounds are fresh.

    python -m pytest tests/e2e/test_backpressure.py -q

Async mode with coordinator.max_staleness=2 lets the producer sample rounds 0-2 with version 0
before the first update.  coordinator.backpressure_d_lag_p95=0 puts backpressure on from the
first learner report (fp32 CPU D_lag is ~1e-6 > 0), so admission uses eta 0: round r can only
be admitted once accepted + running + B <= (v + 1) B, i.e. at version v >= r, and every round
from 3 on is learned with Δv = 0, whatever the timing.  Without the throttle the producer may
sample round 3 with version 1 (Δv 2).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_learner_lag_report_throttles_the_producer(tmp_path):
    d = tmp_path / "run"
    proc = run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=6", "run.eval_every=0",
                   "data.eval_size=8", "run.mode=async", "coordinator.max_staleness=2",
                   "coordinator.max_version_lag=2", "coordinator.backpressure_d_lag_p95=0")
    assert last_json(proc.stdout)["steps"] == 6
    assert "backpressure on (d_lag_p95)" in proc.stderr
    rows = {r["step"]: r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step, row in rows.items():
        assert row["queue/backpressure"] == 1 and row["queue/backpressure_d_lag"] == 1, step
        assert row["queue/admission_eta"] == 0, step
    for step in (4, 5, 6):  # rounds 3, 4, 5: admitted under eta 0
        assert rows[step]["queue/taken_dv/p99"] == 0, (step, rows[step]["queue/taken_dv/p99"])
