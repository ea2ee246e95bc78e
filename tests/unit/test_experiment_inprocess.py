"""Runs inside the experiment runner's process (experiment/inprocess.py): the exit code, output and
signal handlers a run leaves are those its own process would have had / left nothing of.

    python -m pytest tests/unit/test_experiment_inprocess.py -q

The real `megatron-rl` CLI runs in-process for the dry-run and bad-input cases (no Ray); a test
double of `cli.main` injects the failures (a stop condition's SystemExit, a bug).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from megatron_rl import cli
from megatron_rl.experiment.runner import choose_launch, launch_cli, load_experiment
from megatron_rl.experiment.inprocess import check_released, launch_in_process

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"


def test_a_run_in_process_writes_its_output_and_exit_code_to_its_log(tmp_path):
    log = tmp_path / "logs" / "a.log"
    rc = launch_in_process(["train", "--config", str(TINY), f"run.dir={tmp_path / 'run'}", "--dry-run"], log)
    assert rc == 0
    plan = json.loads(log.read_text()[log.read_text().index("{"):])  # the plan, as the process printed it
    assert plan["coordinator"]["batch_size"] == 64
    bad = tmp_path / "logs" / "bad.log"
    assert launch_in_process(["train", "--config", str(TINY), "run.no_such_key=1", "--dry-run"], bad) == 2
    assert "run.no_such_key" in bad.read_text()


@pytest.mark.parametrize("raised, code", [(SystemExit(83), 83), (SystemExit(None), 0), (SystemExit("msg"), 1),
                                          (RuntimeError("a bug in the run"), 1)])
def test_exit_codes_are_the_ones_the_process_would_have(tmp_path, monkeypatch, raised, code):
    def main(argv):
        raise raised

    monkeypatch.setattr(cli, "main", main)
    log = tmp_path / "run.log"
    assert launch_in_process(["train"], log) == code
    if isinstance(raised, RuntimeError):
        assert "a bug in the run" in log.read_text()  # its traceback, where the process would print it


def test_signal_handlers_a_run_installs_are_undone(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)

    def main(argv):  # the driver's StopFlag.install
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGUSR1, lambda *_: None)
        return 0

    usr1 = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(cli, "main", main)
    assert launch_in_process(["train"], tmp_path / "run.log") == 0
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGUSR1) is usr1


def _exp(tmp_path, **fields):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({
        **fields, "base": str(TINY), "dir": str(tmp_path / "exp"), "seeds": [0],
        "preregistration": {"hypothesis": "h", "baseline_arm": "sft"},
        "arms": {"sft": {"command": "sft"}, "grpo": {"command": "train", "init_from": "sft"}}}))
    return load_experiment(path)


def test_in_process_needs_the_shared_cluster(tmp_path):
    assert choose_launch(_exp(tmp_path)) is launch_in_process  # the defaults: shared_ray, in_process
    assert choose_launch(_exp(tmp_path, shared_ray=False)) is launch_cli
    assert choose_launch(_exp(tmp_path, in_process=False)) is launch_cli
    with pytest.raises(ValueError, match="in_process"):
        _exp(tmp_path, in_process="yes")


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
