"""The sbatch path against a real single-node Slurm: multi-node Ray bring-up, requeue drill.

    python -m pytest tests/e2e/test_slurm.py -q      # needs root (installs slurm-wlm + munge)

One job of the tiny recipe with two Slurm tasks (two Ray nodes: head + worker, on this one
machine) is submitted with `megatron-rl submit`.  Once it has committed a checkpoint it gets
USR1 (what Slurm sends before the time limit or on preemption): the driver checkpoints and
exits 75, the script requeues the job, and the next attempt resumes from the newest COMMITTED
checkpoint (the one USR1 made: checkpoints are every 2 steps otherwise).  The job must end COMPLETED
with its step numbers continuing across attempts.  The test cluster's KillWait is 5 s
(launch/slurm_cluster.sh), so the requeued job leaves COMPLETING within seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from tests.e2e.conftest import REPO, TINY, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    script = REPO / "launch" / "slurm_cluster.sh"
    subprocess.run(["bash", str(script), "install"], check=True, timeout=900)
    d = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(script), "start", str(d)], check=True, timeout=120)
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield d
    finally:
        subprocess.run(["bash", str(script), "stop", str(d)], timeout=120)
        os.environ.pop("SLURM_CONF", None)


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "UNKNOWN"


def wait_for(predicate, timeout: float, what: str, poll: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_logs(run_dir, chars: int = 1500) -> str:
    """The tails of the job's own output and of each attempt's logs, for a failure message that says why."""
    files = sorted(run_dir.glob("slurm-*.out")) + sorted((run_dir / "logs").glob("job*/*.log"))
    return "\n".join(f"--- {f.relative_to(run_dir)}:\n{f.read_text(errors='replace')[-chars:]}" for f in files)


def test_sbatch_two_ray_nodes_requeue_and_resume(slurm, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # What a single-node Ray started in the submitting shell leaves in its environment (platform/local_ray.py),
    # which sbatch hands on: the job must still assemble a multi-node cluster.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    steps = 24  # long enough that the signal, sent once step 2 is committed, lands mid-run even on a loaded machine
    proc = run_cli("submit", "--config", str(TINY), "--run-dir", str(run_dir), "--nodes", "1",
                   "--tasks-per-node", "2", "--cpus-per-task", "1", "--time", "00:30:00",
                   f"run.steps={steps}", "run.checkpoint_every=2", "run.eval_every=0", "run.keep_checkpoints=10")
    job = proc.stdout.strip().splitlines()[-1]
    assert job.isdigit(), proc.stdout

    ckpts = run_dir / "checkpoints"
    wait_for(lambda: (ckpts / "step_000002" / "COMMITTED").exists() or job_state(job) in ("FAILED", "COMPLETED"),
             600, "a committed checkpoint at step 2")
    assert job_state(job) == "RUNNING", f"job {job} is {job_state(job)} before the drill\n{job_logs(run_dir)}"
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: job_state(job) == "PENDING", 300, "the job to requeue itself")
    # A requeued job waits out Slurm's begin-time delay; release it now instead.
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    wait_for(lambda: job_state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 900, "the job to finish")

    out_file = next(run_dir.glob("slurm-*.out"))
    out = out_file.read_text()
    assert job_state(job) == "COMPLETED", job_logs(run_dir)
    assert out.count("ray cluster ready: 2 nodes") == 2, "each attempt must assemble a 2-node Ray cluster"
    attempts = sorted(p.name for p in (run_dir / "logs").iterdir() if p.is_dir())
    assert attempts == [f"job{job}.attempt0", f"job{job}.attempt1"], attempts
    # Library and engine logs of both attempts (megatron_rl/console.py), next to the per-attempt logs.
    assert (run_dir / "logs" / "driver.log").is_file() and (run_dir / "logs" / "ray_RolloutWorker.log").is_file()
    second = (run_dir / "logs" / f"job{job}.attempt1" / "driver.log").read_text()
    assert "resumed from" in second

    learn_steps = [r["step"] for r in read_jsonl(run_dir / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert learn_steps == list(range(1, steps + 1)), learn_steps  # continued, nothing recomputed
    assert (ckpts / f"step_{steps:06d}" / "COMMITTED").exists()
    assert any((run_dir / "metrics" / "tb").glob("events.out.tfevents.*"))
