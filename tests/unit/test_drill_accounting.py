"""Drill accounting (megatron_rl/drill/accounting.py): lost and duplicated trajectories, redone steps, versions.

    python -m pytest tests/unit/test_drill_accounting.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.coordinator.wal import WriteAheadLog
from megatron_rl.drill.accounting import account
from megatron_rl.drill.harness import Drill, DrillConfig
from megatron_rl.drill.hooks import ENV, drill_spec, hangs


def _run(tmp_path, consumed_rows, enqueued=(), finished=(), metric_steps=None):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    wal = WriteAheadLog(run / "queue.db")
    wal.commit(enqueued=[(i, tid, 0.0, 0, b"x") for i, tid in enumerate(enqueued)], finished=finished)
    wal.close()
    (run / "consumed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in consumed_rows))
    steps = metric_steps if metric_steps is not None else sorted({r["step"] for r in consumed_rows})
    (run / "metrics" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "learn/loss": 0.1}) + "\n" for s in steps))
    return Drill(DrillConfig(name="oom", config="x.yaml", run_dir=str(run)))


def test_clean_run_has_nothing_lost_or_duplicated(tmp_path):
    rows = [{"step": 1, "time": 1.0, "ids": ["a", "b"]}, {"step": 2, "time": 2.0, "ids": ["c", "d"]}]
    drill = _run(tmp_path, rows, enqueued=["a", "b", "c", "d", "e"],
                 finished=[(t, i, 0, "consumed", "", "step-1", None) for i, t in enumerate("abcd")])
    rec = account(drill)
    assert rec["trajectories_lost"] == 0 and rec["trajectories_duplicated"] == 0  # "e" is still queued
    assert rec["steps_redone"] == 0 and rec["versions_continuous"]


def test_taken_but_never_learned_is_lost_and_twice_learned_is_duplicated(tmp_path):
    # Step 2 was learned in a crashed attempt from c,d; the rerun learned step 2 from a,e: c and d
    # were taken by a learner but no final step learned them and no queue holds or dropped them.
    rows = [{"step": 1, "time": 1.0, "ids": ["a", "b"]}, {"step": 2, "time": 2.0, "ids": ["c", "d"]},
            {"step": 2, "time": 3.0, "ids": ["a", "e"]}]
    drill = _run(tmp_path, rows, enqueued=["a", "b", "e"])
    rec = account(drill)
    assert rec["trajectories_lost"] == 2
    assert rec["trajectories_duplicated"] == 1
    assert rec["steps_redone"] == 1


def test_ids_of_an_earlier_attempts_queue_count_as_acknowledged(tmp_path):
    drill = _run(tmp_path, [{"step": 1, "time": 1.0, "ids": ["a"]}], enqueued=["a"])
    drill.acknowledged |= {"z"}  # queue.db of a crashed attempt held "z"; the final one neither has nor dropped it
    assert account(drill)["trajectories_lost"] == 1
    drill2 = _run(tmp_path / "b", [{"step": 1, "time": 1.0, "ids": ["a"]}], enqueued=["a", "z"],
                  finished=[("z", 1, 0, "dropped", "ttl", None, None)])
    drill2.acknowledged |= {"z"}
    assert account(drill2)["trajectories_lost"] == 0  # dropped with a reason is accounted for


def test_gap_in_logged_steps_breaks_continuity(tmp_path):
    rows = [{"step": 1, "time": 1.0, "ids": ["a"]}, {"step": 3, "time": 2.0, "ids": ["b"]}]
    assert not account(_run(tmp_path, rows, enqueued=["a", "b"]))["versions_continuous"]


def test_drill_config_checks_name_and_step(tmp_path):
    with pytest.raises(ValueError, match="unknown drill"):
        DrillConfig(name="nope", config="x", run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--at-step"):
        DrillConfig(name="oom", config="x", run_dir=str(tmp_path), at_step=4, steps=4)
    with pytest.raises(ValueError, match="even step >= 4"):
        DrillConfig(name="bad_checkpoint", config="x", run_dir=str(tmp_path), at_step=3, steps=5)


def test_hook_spec_parsing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert drill_spec("oom") is None
    monkeypatch.setenv(ENV, json.dumps({"fault": "oom", "at_step": 1}))
    assert drill_spec("oom")["at_step"] == 1 and drill_spec("learner_kill") is None
    monkeypatch.setenv(ENV, "{not json")
    with pytest.raises(ValueError, match=ENV):
        drill_spec("oom")
    monkeypatch.setenv(ENV, json.dumps({"fault": "meteor"}))
    with pytest.raises(ValueError, match="'fault' must be one of"):
        drill_spec("oom")


def test_hang_share_is_roughly_the_fraction():
    spec = {"fraction": 0.25}
    share = sum(hangs(spec, str(i), "7") for i in range(4000)) / 4000
    assert 0.2 < share < 0.3
