"""Runs inside the experiment runner's process (experiment/inprocess.py): the exit code, output and
signal handlers a run leaves are those its own process would have had / left nothing of, and its summary
is the value `run_one` returned; a run in its own process hands its summary back in a file.

    python -m pytest tests/unit/test_experiment_inprocess.py -q

The real config loading and console run in-process for the bad-input case (no Ray); a test double of
`train.cli.run_one` stands for the run and injects the failures (a stop condition's SystemExit, a bug).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from megatron_rl.experiment.config import load_experiment
from megatron_rl.experiment.inprocess import check_released, launch_in_process
from megatron_rl.experiment.runner import choose_launch, launch_process, runner_of
from megatron_rl.experiment.runs import Run
from megatron_rl.train import cli as train_cli

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"


def _run(tmp_path, *overrides: str) -> Run:
    return Run(arm="grpo", seed=0, command="train", base=str(TINY),
               overrides=(f"run.dir={tmp_path / 'run'}", *overrides))


@pytest.fixture
def no_plan(monkeypatch):
    """The checks and console of a real run without its plan (the model and data files of a real run)."""
    monkeypatch.setattr(train_cli, "plan_or_attach", lambda cfg, dry_run: None)


def test_a_run_in_process_returns_its_summary_and_prints_it_to_its_log(tmp_path, monkeypatch, no_plan):
    seen = {}

    def run_one(command, cfg, pool=None):
        seen.update(command=command, seed=cfg.run.seed, pool=pool)
        return {"steps": 2, "generated_tokens": 40}

    monkeypatch.setattr(train_cli, "run_one", run_one)
    log = tmp_path / "logs" / "a.log"
    pool = object()
    out = launch_in_process(_run(tmp_path, "run.seed=7"), log, pool=pool)
    assert out.code == 0 and out.summary == {"steps": 2, "generated_tokens": 40}
    assert seen == {"command": "train", "seed": 7, "pool": pool}  # the config from the overrides, the pool passed
    assert json.loads(log.read_text().strip().splitlines()[-1]) == out.summary  # the final JSON line, as the CLI's


def test_bad_input_in_process_is_exit_2_named_in_its_log(tmp_path):
    bad = tmp_path / "logs" / "bad.log"
    out = launch_in_process(_run(tmp_path, "run.no_such_key=1"), bad)
    assert out.code == 2 and out.summary == {}
    assert "run.no_such_key" in bad.read_text()


@pytest.mark.parametrize("raised, code", [(SystemExit(83), 83), (SystemExit(None), 0), (SystemExit("msg"), 1),
                                          (RuntimeError("a bug in the run"), 1)])
def test_exit_codes_are_the_ones_the_process_would_have(tmp_path, monkeypatch, no_plan, raised, code):
    def run_one(command, cfg, pool=None):
        raise raised

    monkeypatch.setattr(train_cli, "run_one", run_one)
    log = tmp_path / "run.log"
    out = launch_in_process(_run(tmp_path), log)
    assert out.code == code and out.summary == {}
    if isinstance(raised, RuntimeError):
        assert "a bug in the run" in log.read_text()  # its traceback, where the process would print it


def test_signal_handlers_a_run_installs_are_undone(tmp_path, monkeypatch, no_plan):
    before = signal.getsignal(signal.SIGTERM)

    def run_one(command, cfg, pool=None):  # the driver's StopFlag.install
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        return {}

    usr1 = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(train_cli, "run_one", run_one)
    assert launch_in_process(_run(tmp_path), tmp_path / "run.log").code == 0
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGUSR1) is usr1


def test_a_run_in_its_own_process_hands_its_summary_back_in_a_file(tmp_path, monkeypatch):
    def fake(argv, stdout, stderr, check, env):  # stands for `megatron-rl train --summary-out PATH ...`
        assert argv[3:5] == ["train", "--config"] and argv[6] == "--summary-out"
        assert "MEGATRON_RL_DRILL" not in env  # an unfaulted run arms nothing
        stdout.write('{"steps": 99}\n')  # a JSON line in the log is not what the runner reads
        Path(argv[7]).write_text(json.dumps({"steps": 2}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fake)
    log = tmp_path / "logs" / "grpo_seed_0.log"
    out = launch_process(_run(tmp_path), log)
    assert out.code == 0 and out.summary == {"steps": 2}
    assert (tmp_path / "logs" / "grpo_seed_0.summary.json").is_file()


def _exp(tmp_path, **fields):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({
        **fields, "base": str(TINY), "dir": str(tmp_path / "exp"), "seeds": [0],
        "preregistration": {"hypothesis": "h", "baseline_arm": "sft"},
        "arms": {"sft": {"command": "sft"}, "grpo": {"command": "train", "init_from": "sft"}}}))
    return load_experiment(path)


def test_in_process_and_pooled_need_the_shared_cluster(tmp_path):
    assert runner_of(_exp(tmp_path)) == "pooled"  # the defaults: shared_ray, runner: pooled
    assert runner_of(_exp(tmp_path, runner="in_process")) == "in_process"
    for fields in ({"shared_ray": False}, {"shared_ray": False, "runner": "in_process"}, {"runner": "process"}):
        assert runner_of(_exp(tmp_path, **fields)) == "process"
    assert choose_launch("process") is launch_process
    pool = object()
    launch = choose_launch("pooled", pool)
    assert launch.func is launch_in_process and launch.keywords == {"pool": pool}
    with pytest.raises(ValueError, match="shared_ray"):
        _exp(tmp_path, shared_ray="yes")


def test_resources_a_previous_run_still_holds_are_named(monkeypatch, caplog):
    import ray

    held = {"CPU": 2.0, "GPU": 0.0}
    free = {"CPU": 1.75}  # an actor of the last run (a CPU share of its bundle) did not end: injected
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: held)
    monkeypatch.setattr(ray, "available_resources", lambda: free)
    with caplog.at_level("WARNING"):
        assert check_released(timeout_s=0.2) is False
    assert "{'CPU': 0.25}" in caplog.text
    free["CPU"] = 2.0
    assert check_released(timeout_s=0.2) is True


def test_a_pools_reservation_not_yet_in_rays_view_is_not_taken_for_released(monkeypatch):
    """Ray's resource view lags a new placement group: for a moment the pool's own reservation is not subtracted
    from the free CPUs.  Less held than the pool keeps says nothing of the rest, so check_released waits for the
    view (it answered True at once before: a CI run's test_engine_pool saw it)."""
    import ray

    class Pool:
        def reserved(self):
            return {"CPU": 0.5}

    views = iter([2.0, 2.0, 1.5])  # free CPUs of 2: twice before the reservation shows, then with it (injected)
    last = {"CPU": 2.0}

    def available():
        last["CPU"] = next(views, last["CPU"])
        return dict(last)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", available)
    assert check_released(Pool(), timeout_s=0.2) is False  # its one look within 0.2 s: the view lags
    assert check_released(Pool(), timeout_s=5.0) is True  # the reservation shows: nothing else is held
    assert check_released(None, timeout_s=0.2) is False  # without the pool, its reservation is held
