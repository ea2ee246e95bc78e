"""An experiment arm that injects faults (Arm.faults): checked by name, launched as its own process with its
own Ray and the fault armed in its environment only; no other run sees it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.fault_hooks import ENV
from megatron_rl.experiment.config import load_experiment
from megatron_rl.experiment.runs import Outcome, plan_run

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TIMEOUTS = [{"fault": "verifier_timeout", "fraction": 0.1}]


def _experiment(tmp_path, faults=TIMEOUTS, sft_faults=None, **fields):
    arms = {"sft": {"command": "sft", "overrides": ["sft.steps=3"]},
            "clean": {"command": "train", "init_from": "sft", "overrides": ["run.steps=4"]},
            "faulty": {"command": "train", "init_from": "sft", "overrides": ["run.steps=4"], "faults": faults}}
    if sft_faults is not None:
        arms["sft"]["faults"] = sft_faults
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({
        "shared_ray": True, **fields, "base": str(REPO / "configs" / "tiny_cpu.yaml"), "dir": str(tmp_path / "exp"),
        "preregistration": {"hypothesis": "h", "baseline_arm": "clean"}, "arms": arms}))
    return load_experiment(path)


def test_bad_faults_are_named_with_their_arm(tmp_path):
    with pytest.raises(ConfigError) as err:
        _experiment(tmp_path, faults=[{"fault": "verifier_timeout"}, {"fault": "meteor"}, "oom"],
                    sft_faults=TIMEOUTS)
    text = str(err.value)
    assert "arms.faulty.faults[1] must be a mapping with 'fault' one of" in text and "'meteor'" in text
    assert "arms.faulty.faults[2]" in text and "arms.faulty.faults[0]" not in text
    assert "arms.sft.faults: only a train run is injected with faults" in text


def test_a_faulted_run_carries_its_faults_and_starts_its_own_ray(tmp_path, monkeypatch):
    cfg = _experiment(tmp_path)
    clean, faulty = plan_run(cfg, "clean", 0), plan_run(cfg, "faulty", 0)
    assert clean.faults == "" and json.loads(faulty.faults) == TIMEOUTS
    assert "run.use_existing_ray=true" in clean.overrides  # the runner's shared cluster
    assert "run.use_existing_ray=true" not in faulty.overrides  # its own: the fault reaches its actors only
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv(ENV, json.dumps({"fault": "oom", "at_step": 1}))  # left over in the runner's environment
    assert ENV not in clean.environment() and clean.environment()["RAY_ADDRESS"] == "10.0.0.1:6379"
    env = faulty.environment()
    assert json.loads(env[ENV]) == TIMEOUTS and "RAY_ADDRESS" not in env


def test_the_runner_launches_a_faulted_run_as_a_process_whatever_it_chose(tmp_path, monkeypatch):
    import megatron_rl.experiment.runner as runner

    cfg = _experiment(tmp_path, runner="in_process", shared_ray=False)
    launched: list[tuple[str, str]] = []

    def launcher(kind):
        def launch(run, log):
            launched.append((kind, run.arm))
            d = Path(next(a.split("=", 1)[1] for a in run.overrides if a.startswith("run.dir=")))
            d.mkdir(parents=True, exist_ok=True)
            return Outcome(0, {"steps": 4})
        return launch

    monkeypatch.setattr(runner, "runner_of", lambda cfg: "in_process")
    monkeypatch.setattr(runner, "choose_launch", lambda kind, pool=None: launcher("in_process"))
    monkeypatch.setattr(runner, "launch_process", launcher("process"))
    runner.run_all(cfg)
    assert sorted(set(launched)) == [("in_process", "clean"), ("in_process", "sft"), ("process", "faulty")]


def test_a_faulted_run_is_refused_inside_the_runners_process(tmp_path):
    from megatron_rl.experiment.inprocess import launch_in_process

    run = plan_run(_experiment(tmp_path), "faulty", 0)
    with pytest.raises(ValueError, match="injects faults and must run as its own process"):
        launch_in_process(run, tmp_path / "log")


def test_a_bad_draw_of_the_verifier_timeout_is_named_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match=r"arms\.faulty\.faults\[0\]\.per must be one of \['input', 'call'\]"):
        _experiment(tmp_path, faults=[{"fault": "verifier_timeout", "fraction": 0.1, "per": "sometimes"}])
