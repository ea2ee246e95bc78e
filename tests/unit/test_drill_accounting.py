"""Drill accounting (megatron_rl/drill/accounting.py): lost and duplicated trajectories, redone steps, versions.

    python -m pytest tests/unit/test_drill_accounting.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.coordinator.wal import WriteAheadLog
from megatron_rl.drill.accounting import account
from megatron_rl.drill.harness import Drill, DrillConfig
from megatron_rl.fault_hooks import ENV, drill_spec, hangs


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


def test_several_faults_armed_in_one_run(monkeypatch):
    """`megatron-rl drill together`: MEGATRON_RL_DRILL holds a list; each hook finds its own spec."""
    specs = [{"fault": "engine_kill", "at_step": 1}, {"fault": "engine_kill_publish", "at_version": 2}]
    monkeypatch.setenv(ENV, json.dumps(specs))
    assert drill_spec("engine_kill")["at_step"] == 1 and drill_spec("engine_kill_publish")["at_version"] == 2
    assert drill_spec("oom") is None
    monkeypatch.setenv(ENV, json.dumps(specs + [{"fault": "engine_kill", "at_step": 2}]))
    with pytest.raises(ValueError, match="armed once per run"):
        drill_spec("engine_kill")
    monkeypatch.setenv(ENV, json.dumps([specs[0], {"fault": "meteor"}]))
    with pytest.raises(ValueError, match="'fault' must be one of"):
        drill_spec("engine_kill")


def test_drills_together_are_timed_from_their_own_injection(tmp_path):
    from megatron_rl.drill.accounting import recovery_time

    drill = _run(tmp_path, [{"step": 1, "time": 10.0, "ids": ["a"]}, {"step": 2, "time": 30.0, "ids": ["b"]}],
                 enqueued=["a", "b"])
    events = [{"fault": "verifier_timeout", "time": 5.0}, {"fault": "coordinator_stop", "time": 12.0},
              {"fault": "verifier_timeout", "time": 13.0}]
    (drill.run_dir / "drill_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert len(drill.injections()) == 3 and len(drill.injections("verifier_timeout")) == 2
    assert recovery_time(drill) == 5.0 and recovery_time(drill, "coordinator_stop") == 18.0
    assert recovery_time(drill, "engine_kill") is None


def test_drills_together_names_are_checked():
    from megatron_rl.drill.together import TOGETHER, check_names

    assert {"engine_crash", "engine_crash_publish", "verifier_timeout", "bad_refit", "coordinator_stop"} == set(TOGETHER)
    check_names(["engine_crash", "engine_crash_publish"])
    for names, msg in ((["oom", "bad_refit"], "oom cannot share a run"), (["bad_refit", "bad_refit"], "named twice"),
                       ([], "names no drill")):
        with pytest.raises(ValueError, match=msg):
            check_names(names)


def test_each_engine_death_is_judged_by_the_refit_after_it():
    from megatron_rl.drill.faults import _first_line_after

    log = ("x WARNING rollout group 0 refitted: serving policy version 0 (bytes verified)\n"
           "x ERROR vLLM engine died during generation of round 1\n"
           "x WARNING rollout group 0 refitted: serving policy version 1 (bytes verified)\n"
           "x ERROR vLLM engine died during publication of version 2\n"
           "x WARNING rollout group 0 refitted: serving policy version 2 (bytes verified)\n")
    refit = r"refitted: serving policy version \d+"
    assert _first_line_after(log, "died during generation", refit).endswith("version 1 (bytes verified)")
    assert _first_line_after(log, "died during publication", refit).endswith("version 2 (bytes verified)")
    assert _first_line_after(log, "died while asleep", refit) is None
