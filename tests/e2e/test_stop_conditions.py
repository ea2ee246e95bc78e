"""A stop condition ends a real run: checkpoint (COMMITTED), its own exit code, its name.

    python -m pytest tests/e2e/test_stop_conditions.py -q

One real CLI run of the tiny recipe with stop.d_lag_p95_max=0: any learner/behaviour lag at
all (fp32 CPU gives ~1e-6) crosses it at step 1 of 3, so the run must checkpoint step 1 and
exit 85 (lag_p95), naming the condition in the log and in its final JSON line.  `megatron-rl
doctor` on that run then points at the lag leaf of the runbook.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.train.stop import EXIT_CODES
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_lag_p95_stop_checkpoints_and_exits_with_its_code(tmp_path):
    d = tmp_path / "run"
    proc = run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=3", "run.eval_every=0",
                   "data.eval_size=8", "stop.d_lag_p95_max=0", check=False)
    assert proc.returncode == EXIT_CODES["lag_p95"] == 85, proc.stderr[-4000:]
    final = last_json(proc.stdout)
    assert final["stopped"] == "lag_p95" and final["exit_code"] == 85 and final["checkpointed"] is True
    assert final["step"] == 1 and final["metric"] == "learn/d_lag/p95" and final["value"] > 0
    assert "stop condition lag_p95 at step 1" in proc.stderr
    ckpts = sorted((d / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_000001"] and (ckpts[0] / "COMMITTED").is_file()
    steps = [r["step"] for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert steps == [1]  # stopped: no step 2

    doc = run_cli("doctor", str(d), "--json", check=False)
    assert doc.returncode == 1
    leaves = {f["leaf"] for f in json.loads(doc.stdout)["findings"]}
    assert "lag-rising" in leaves and "publication-refused" not in leaves, doc.stdout
    assert json.loads((d / "stop_condition.json").read_text())["stopped"] == "lag_p95"
