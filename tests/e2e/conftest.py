"""Helpers for end-to-end tests that run the real `megatron-rl` CLI in a subprocess, the suite's one Ray
cluster (`SHARED_RAY`, started on first need) that CLI runs join, a Ray cluster for tests that drive
RolloutWorker actors themselves (`rollout_cluster`), and the one run two modules share
(`worker_crash`).

    python -m pytest tests/e2e -q

A CLI run of `train`, `sft`, `drill` or `reconcile` joins the shared cluster (`run.use_existing_ray=true`,
RAY_ADDRESS) instead of starting its own: one Ray start-up a session instead of one a run.  A test that must
have a Ray of its own says so with `@pytest.mark.own_ray("why, in one line")` (module or test); its CLI runs
then start their own, as a user's would; MEGATRON_RL_TESTS_OWN_RAY=1 gives every run its own (to time the
difference).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"  # GRPO from a random tiny model: the quickest whole run


class SharedRay:
    """The session's Ray cluster, owned by a `python -m tests.e2e.ray_head` process started on first need and
    stopped at the session's end (closing its stdin; it also stops if pytest dies)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.env: dict[str, str] = {}  # what a client needs beside the address (Ray's auth mode)

    def start(self, timeout: float = 180) -> str:
        if self.address is not None and self.proc is not None and self.proc.poll() is None:
            return self.address
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.ray_head"], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    head = json.loads(line)
                    self.address, self.env = head["address"], head["env"]
                    return self.address
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError("the suite's shared Ray cluster did not start (python -m tests.e2e.ray_head)")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc, self.address, self.env = None, None, {}


SHARED_RAY = SharedRay()
_OWN_RAY: list = []  # the running test's own_ray marker, if any (pytest_runtest_setup)
JOINS_RAY = ("train", "sft", "drill", "reconcile")  # the subcommands that start Ray (train/run_setup.start_ray)


def pytest_runtest_setup(item):
    # Runs before the item's fixtures are set up, so a module fixture's CLI runs see the marker too.
    _OWN_RAY[:] = [item.get_closest_marker("own_ray")] if item.get_closest_marker("own_ray") else []


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stops_at_the_end():
    yield
    SHARED_RAY.stop()


@contextlib.contextmanager
def rollout_cluster():
    """A local Ray cluster of this process whose actors import this checkout, and a list for the RolloutWorker
    actors the test starts: at the end each one is shut down, then Ray, and PYTHONPATH is as it was.  (Not the
    shared cluster: Ray reads its auth mode once, at import, and this process imported it long before.)"""
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


def cli_env_and_args(args: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
    """The environment and arguments of a CLI run: one that starts Ray joins the shared cluster, unless the
    running test is marked own_ray or it is a dry run (which starts no Ray)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    shared = os.environ.get("MEGATRON_RL_TESTS_OWN_RAY") != "1"  # =1: every run starts its own (A/B timing)
    if shared and args and args[0] in JOINS_RAY and not _OWN_RAY and "--dry-run" not in args:
        env["RAY_ADDRESS"] = SHARED_RAY.start()
        env.update(SHARED_RAY.env)
        args = (*args, "run.use_existing_ray=true")
    return env, args


def run_cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env, args = cli_env_and_args(args)
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
