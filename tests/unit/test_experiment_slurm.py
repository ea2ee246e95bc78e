"""Experiments under Slurm (megatron_rl/experiment/slurm.py): one array job per arm with a task per
unfinished seed, dependencies in arm order, a report job after all of them, and the array task
that runs one (arm, seed) and records its result.

    python -m pytest tests/unit/test_experiment_slurm.py -q

sbatch itself is replaced by a recorder (the real submission is tests/e2e/test_slurm.py's
territory, and was run by hand: see the notes); the scripts are checked with `bash -n`.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from megatron_rl.experiment.runs import Outcome
from megatron_rl.experiment.slurm import SlurmOptions, run_task, submit
from tests.unit.test_experiment import _experiment, _fake_run

pytestmark = pytest.mark.unit


def _recorder():
    submitted = []

    def submit_one(script: Path, deps: list[str]) -> str:
        submitted.append((script.name, list(deps)))
        return str(100 + len(submitted))

    return submit_one, submitted


def test_one_array_per_arm_with_dependencies_and_a_report_job(tmp_path):
    cfg = _experiment(tmp_path, budget_generated_tokens=500)
    done = Path(cfg.dir) / "runs" / "sft" / "seed_1"  # finished earlier: not resubmitted
    done.mkdir(parents=True)
    (done / "result.json").write_text("{}")
    submit_one, submitted = _recorder()
    out = submit(cfg, tmp_path / "exp.yaml", SlurmOptions(time_limit="01:00:00", extra=["--partition=cpu"]),
                 submit_one=submit_one)
    assert submitted == [("sft.sbatch", []), ("grpo.sbatch", ["101"]), ("report.sbatch", ["101", "102"])]
    assert out["jobs"] == {"sft": "101", "grpo": "102", "report": "103"}
    assert json.loads((Path(cfg.dir) / "slurm" / "jobs.json").read_text()) == out["jobs"]
    assert (Path(cfg.dir) / "preregistration.json").is_file()  # written at submission, before any task
    sft = (Path(cfg.dir) / "slurm" / "sft.sbatch").read_text()
    grpo = (Path(cfg.dir) / "slurm" / "grpo.sbatch").read_text()
    assert "#SBATCH --array=0,2\n" in sft and "#SBATCH --array=0,1,2\n" in grpo
    assert "#SBATCH --partition=cpu" in sft and "#SBATCH --time=01:00:00" in sft
    # The packaged template's Ray bring-up and requeue, its driver one run of the experiment.
    assert "ray\" start --head" in sft and "scontrol requeue" in sft
    driver = re.search(r'megatron-rl" (.*) \\\n', sft).group(1)
    assert driver == f"experiment --config {tmp_path / 'exp.yaml'} --task sft"
    report = (Path(cfg.dir) / "slurm" / "report.sbatch").read_text()
    assert report.rstrip().endswith(f"experiment --config {tmp_path / 'exp.yaml'}")
    for name in ("sft", "grpo", "report"):
        check = subprocess.run(["bash", "-n", str(Path(cfg.dir) / "slurm" / f"{name}.sbatch")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_dry_run_submits_and_registers_nothing(tmp_path):
    cfg = _experiment(tmp_path)
    submit_one, submitted = _recorder()
    out = submit(cfg, tmp_path / "exp.yaml", SlurmOptions(), dry_run=True, submit_one=submit_one)
    assert sorted(out["scripts"]) == ["grpo", "report", "sft"] and submitted == []
    assert not (Path(cfg.dir) / "preregistration.json").exists()


def test_an_arm_whose_runs_all_finished_is_not_submitted(tmp_path):
    cfg = _experiment(tmp_path, seeds=(0,))
    d = Path(cfg.dir) / "runs" / "sft" / "seed_0"
    d.mkdir(parents=True)
    (d / "result.json").write_text("{}")
    submit_one, submitted = _recorder()
    submit(cfg, tmp_path / "exp.yaml", SlurmOptions(), submit_one=submit_one)
    assert submitted == [("grpo.sbatch", []), ("report.sbatch", ["101"])]  # its base is done: no dependency


def test_an_array_task_runs_its_seed_against_the_jobs_cluster_and_records_it(tmp_path, monkeypatch):
    cfg = _experiment(tmp_path, budget_generated_tokens=500)
    launch, calls = _fake_run({"sft": 0.3, "grpo": 0.9})
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert run_task(cfg, "grpo", launch=launch) == 0
    (args,) = calls
    assert "run.seed=2" in args and "run.use_existing_ray=true" in args and "stop.max_generated_tokens=500" in args
    result = json.loads((Path(cfg.dir) / "runs" / "grpo" / "seed_2" / "result.json").read_text())
    assert result["seed"] == 2 and result["stopped"] == "max_generated_tokens"
    assert run_task(cfg, "grpo", launch=launch) == 0 and len(calls) == 1  # requeued after it finished: skipped
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    with pytest.raises(ValueError, match="array task 3 has no seed"):
        run_task(cfg, "grpo", launch=launch)
    with pytest.raises(ValueError, match="--task 'nope' is not an arm"):
        run_task(cfg, "nope", launch=launch)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID"):
        run_task(cfg, "grpo", launch=launch)


def test_a_failed_array_task_writes_no_result(tmp_path):
    cfg = _experiment(tmp_path)
    assert run_task(cfg, "sft", index=0, launch=lambda run, log: Outcome(75)) == 75  # requeue: Slurm runs it again
    assert not (Path(cfg.dir) / "runs" / "sft" / "seed_0" / "result.json").exists()
