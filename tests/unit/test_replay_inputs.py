"""What `megatron-rl replay` needs of a run directory, and its refusals (issue 47 item 4).  The bit-identical
replay itself runs on a real streaming run in tests/e2e/test_streaming.py.

    python -m pytest tests/unit/test_replay_inputs.py -q
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.config import load_config, to_dict
from megatron_rl.replay import consumed_steps
from megatron_rl.train.config import TrainConfig


pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def _run_dir(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(load_config(TrainConfig, REPO / "configs" / "tiny_cpu_scratch.yaml"))))
    (run / "consumed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with sqlite3.connect(run / "queue.db") as db:
        db.execute("CREATE TABLE traj (seq INTEGER PRIMARY KEY, id TEXT, enqueued_at REAL, min_version INTEGER, "
                   "payload BLOB)")
    return run


def test_the_last_line_of_a_step_counts_and_a_resumed_attempt_starts_with_a_canary(tmp_path):
    run = _run_dir(tmp_path, [{"step": 1, "pid": 10, "ids": ["a"]}, {"step": 2, "pid": 10, "ids": ["b"]},
                              {"step": 3, "pid": 10, "ids": ["lost"]},            # crashed before its checkpoint
                              {"step": 3, "pid": 11, "ids": ["c"]}, {"step": 4, "pid": 11, "ids": ["d"]}])
    steps = consumed_steps(run)
    assert {s: r.ids for s, r in steps.items()} == {1: ["a"], 2: ["b"], 3: ["c"], 4: ["d"]}
    assert [s for s, r in steps.items() if r.canary] == [3]


def test_a_run_without_its_consumed_trajectories_is_one_line_naming_keep_consumed(tmp_path, capsys):
    run = _run_dir(tmp_path, [{"step": 1, "pid": 1, "ids": ["a", "b"]}, {"step": 2, "pid": 1, "ids": ["c"]}])
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert "3 of the 3 trajectories" in err and "coordinator.keep_consumed: true" in err and "Traceback" not in err
    assert main(["replay", str(run), "--from-step", "2"]) == 2
    assert "0 <= --from-step < --to-step <= 2" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "nowhere")]) == 2
