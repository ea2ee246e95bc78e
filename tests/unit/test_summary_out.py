"""`--summary-out`: the run's final JSON line reaches the file whoever launched it reads (the experiment
runner, the drills), also when a stop condition or a signal ended the run, so that no one reads it from a log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.reporting.stop import StopCondition, StopConditionMet

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"


def _run(monkeypatch, tmp_path, outcome):
    import megatron_rl.train.cli as train_cli
    import megatron_rl.train.driver as driver
    from megatron_rl.cli import main

    def fake_train(cfg, stop=None, pool=None):  # the failure injected: how the run ended
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(driver, "train", fake_train)
    monkeypatch.setattr(train_cli, "plan_or_attach", lambda cfg, dry_run: None)
    out = tmp_path / "summary.json"
    out.write_text("{}")  # a stale file must not survive as this run's
    try:
        rc = main(["train", "--config", str(TINY), "--summary-out", str(out), f"run.dir={tmp_path / 'run'}"])
    except SystemExit as exc:
        rc = exc.code
    return rc, json.loads(out.read_text()) if out.is_file() else None


def test_a_finished_run_writes_its_summary(monkeypatch, tmp_path, capsys):
    rc, written = _run(monkeypatch, tmp_path, {"steps": 3, "version": 4})
    assert rc == 0 and written == {"steps": 3, "version": 4}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == written  # the same line, printed once


def test_a_stop_condition_writes_its_stop_with_its_exit_code(monkeypatch, tmp_path, capsys):
    condition = StopCondition("audit", 2, "audit/max_abs_diff", 0.27, "> tolerance 0.001")
    rc, written = _run(monkeypatch, tmp_path, StopConditionMet(condition))
    assert rc == condition.exit_code != 0
    assert written == {**condition.to_dict(), "checkpointed": True}
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in printed] == [written]  # printed once, not twice


def test_a_signal_stop_writes_that_it_checkpointed(monkeypatch, tmp_path):
    rc, written = _run(monkeypatch, tmp_path, SystemExit(75))
    assert rc == 75 and written == {"stopped": "signal", "checkpointed": True}


@pytest.mark.parametrize("code", [1, 87])
def test_other_exits_leave_no_summary(monkeypatch, tmp_path, code):
    from megatron_rl.cli import CommandError

    rc, written = _run(monkeypatch, tmp_path, CommandError("stopped: out of memory", exit_code=code))
    assert rc == code and written is None
