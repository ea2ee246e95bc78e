"""Helpers for end-to-end tests that run the real `megatron-rl` CLI in a subprocess, a Ray cluster for
tests that drive RolloutWorker actors themselves (`rollout_cluster`), and the one run two modules share
(`worker_crash`).

    python -m pytest tests/e2e -q
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"  # GRPO from a random tiny model: the quickest whole run


@contextlib.contextmanager
def rollout_cluster():
    """A local Ray cluster whose actors import this checkout, and a list for the RolloutWorker actors the
    test starts: at the end each one is shut down, then Ray, and PYTHONPATH is as it was."""
    import ray

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers: list = []
    try:
        yield workers
    finally:
        for w in workers:
            try:
                ray.get(w.shutdown.remote(), timeout=60)
            except ray.exceptions.RayError:
                pass
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def run_cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"megatron-rl {' '.join(args)} exited {proc.returncode}\n--- stderr tail ---\n"
                    f"{proc.stderr[-6000:]}")
    return proc


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout[-2000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drill(tmp_path_factory, name: str, *args: str) -> tuple[int, dict]:
    """`megatron-rl drill NAME` on the tiny recipe in a fresh directory: (exit code, its JSON record)."""
    run_dir = tmp_path_factory.mktemp(f"drill_{name}") / "run"
    proc = run_cli("drill", name, "--config", str(TINY), "--run-dir", str(run_dir), *args, check=False)
    assert "{" in proc.stdout, proc.stderr[-4000:]
    return proc.returncode, last_json(proc.stdout)


@pytest.fixture(scope="session")
def worker_crash(tmp_path_factory):
    """The worker_crash drill with a checkpoint at every step: learner rank 0 SIGKILLed in step 3 of 4, the
    rerun resumed from step 2.  Its steps 1-4 are those of an uninterrupted run (resume is exact;
    tests/e2e/test_drills.py checks both), so tests/e2e/test_bad_checkpoint.py damages copies of it
    instead of training a run of its own: one start-up less in the suite."""
    return drill(tmp_path_factory, "worker_crash", "run.learner_timeout_s=60", "run.checkpoint_every=1",
                 "run.keep_checkpoints=4")
