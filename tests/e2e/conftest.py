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

Independent CLI runs of one module start two at a time (`start_cli`: this suite's machines have 2 cores, and
a run spends most of its ~30 s starting Python, an engine and a learner); each run's result is still read,
and checked, by a fixture of its own, so a failed run fails only the tests that read it.  Runs whose tests
depend on timing (armed faults, streaming refits, time limits) run alone.
"""

from __future__ import annotations

import contextlib
import json
import locale
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.warm_cli import Servers

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
WARM = Servers(REPO)  # CLI runs fork from a warm Python (tests/e2e/warm_cli.py), unless asked to be fresh
JOINS_RAY = ("train", "sft", "drill", "reconcile")  # the subcommands that start Ray (train/run_setup.start_ray)


def pytest_runtest_setup(item):
    # Runs before the item's fixtures are set up, so a module fixture's CLI runs see the marker too.
    _OWN_RAY[:] = [item.get_closest_marker("own_ray")] if item.get_closest_marker("own_ray") else []


def pytest_runtest_teardown(item):
    # The marker is the running test's: after it, tests that follow in the same session (the unit tier's run after
    # the e2e tier's) see none.
    _OWN_RAY.clear()


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stops_at_the_end():
    yield
    WARM.stop()
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


def cli_env_and_args(args: tuple[str, ...], own_ray: bool = False) -> tuple[dict, tuple[str, ...]]:
    """The environment and arguments of a CLI run: one that starts Ray joins the shared cluster, unless the
    running test is marked own_ray, `own_ray` is asked for, or it is a dry run (which starts no Ray)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    shared = os.environ.get("MEGATRON_RL_TESTS_OWN_RAY") != "1"  # =1: every run starts its own (A/B timing)
    if shared and args and args[0] in JOINS_RAY and not (_OWN_RAY or own_ray) and "--dry-run" not in args:
        env["RAY_ADDRESS"] = SHARED_RAY.start()
        env.update(SHARED_RAY.env)
        args = (*args, "run.use_existing_ray=true")
    return env, args


def cli_command(args: tuple[str, ...], env: dict, fresh: bool = False) -> tuple[list[str], dict]:
    """`megatron-rl ARGS`: forked from a warm Python (tests/e2e/warm_cli.py), or, with `fresh` (a test that reads
    what a forked run does not do as a fresh one: the module's docstring) or under MEGATRON_RL_TESTS_FRESH_CLI=1
    (every run: to time the difference), a fresh one."""
    if fresh or os.environ.get("MEGATRON_RL_TESTS_FRESH_CLI") == "1":
        return [sys.executable, "-m", "megatron_rl.cli", *args], env
    return WARM.command(args, env)


def _fail_unless_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        pytest.fail(f"megatron-rl {' '.join(proc.args[3:])} exited {proc.returncode}\n--- stderr tail ---\n"
                    f"{proc.stderr[-6000:]}")


def run_cli(*args: str, timeout: float = 900, check: bool = True, fresh: bool = False,
            own_ray: bool = False) -> subprocess.CompletedProcess:
    env, args = cli_env_and_args(args, own_ray)
    cmd, env = cli_command(args, env, fresh=fresh)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        _fail_unless_ok(proc)
    return proc


class StartedCli:
    """A CLI run started by `start_cli` (or any command, `StartedCli(cmd, env)`), going on while the test
    starts another.  Its output goes to files (not pipes, which a run waited on second could fill and block
    on).  `result()` is what run_cli gives."""

    def __init__(self, cmd: list[str], env: dict, check: bool = False, cwd: Path = REPO) -> None:
        self.check = check
        self._files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        self._started = time.monotonic()
        self._done: subprocess.CompletedProcess | None = None
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._files[0], stderr=self._files[1])
        _STARTED.append(self)

    def _read(self, i: int) -> str:  # as subprocess.run(text=True) decodes: locale encoding, universal newlines
        self._files[i].seek(0)
        text = self._files[i].read().decode(locale.getpreferredencoding(False))
        return text.replace("\r\n", "\n").replace("\r", "\n")

    def finish(self, timeout: float = 900) -> subprocess.CompletedProcess:
        """Waits for the run's end (TIMEOUT seconds from its start, as run_cli's) and checks nothing."""
        if self._done is None:
            try:
                self.proc.wait(timeout=max(0.0, self._started + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise subprocess.TimeoutExpired(self.proc.args, timeout, self._read(0), self._read(1)) from None
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self._read(0),
                                                     self._read(1))
            for f in self._files:
                f.close()
        return self._done

    def result(self, timeout: float = 900) -> subprocess.CompletedProcess:
        """The finished run; with check (the default), the calling test or fixture fails as under run_cli when
        its exit code is not 0 (every caller: each fixture that reads the run fails by itself)."""
        proc = self.finish(timeout)
        if self.check:
            _fail_unless_ok(proc)
        return proc

    def running(self) -> bool:
        return self._done is None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


_STARTED: list[StartedCli] = []


def start_cli(*args: str, check: bool = True, fresh: bool = False, own_ray: bool = False) -> StartedCli:
    """`megatron-rl ARGS` started and not waited for, in run_cli's environment (the shared Ray cluster, or its
    own under own_ray): start a second, independent run, then read each one's `.result()` in its own fixture.
    At most two at a time, and never beside a run whose tests depend on timing."""
    env, args = cli_env_and_args(args, own_ray)
    cmd, env = cli_command(args, env, fresh=fresh)
    return StartedCli(cmd, env, check)


def first_to_finish(*started: StartedCli, timeout: float = 900) -> StartedCli:
    """Whichever of the runs ends first (to start the next one then: two at a time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in started:
            if not s.running():
                return s
        time.sleep(0.5)
    raise subprocess.TimeoutExpired([s.proc.args for s in started], timeout)


def wanted(request, *fixtures: str) -> bool:
    """Whether a selected test (after -k/-m) uses one of the fixtures -- a test of the requesting fixture's
    module when that fixture is module-scoped: a run is started beside another only when a test will read
    it."""
    items = request.session.items
    if request.scope == "module":
        items = [i for i in items if i.nodeid.startswith(request.node.nodeid + "::")]
    return any(name in item.fixturenames for item in items for name in fixtures)


class TwoAtATime:
    """Runs started in the order they were added, at most two running at once: `run(key)` waits for that
    run, and starts the next queued one whenever a running one ends meanwhile."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, object]] = []
        self.started: dict[str, StartedCli] = {}

    def add(self, key: str, start) -> None:
        """`start()` starts the run (returns a StartedCli) when its turn comes."""
        self.queue.append((key, start))
        self._fill()

    def _fill(self) -> None:
        while self.queue and sum(s.running() for s in self.started.values()) < 2:
            key, start = self.queue.pop(0)
            self.started[key] = start()

    def run(self, key: str) -> StartedCli:
        """The run `key`, ended (its result not checked yet: `.result()`)."""
        if key not in self.started and key not in dict(self.queue):
            raise KeyError(f"no run {key!r} was added")
        while key not in self.started or self.started[key].running():
            running = [s for s in self.started.values() if s.running()]
            if running:
                first_to_finish(*running)
            self._fill()
        return self.started[key]

    def close(self) -> None:
        """Ends what a failed reader left running, and starts nothing more."""
        self.queue.clear()
        for s in self.started.values():
            s.kill()


@pytest.fixture(scope="session", autouse=True)
def _started_runs_end_with_the_session():
    yield
    for s in _STARTED:
        s.kill()


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout[-2000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_drill(tmp_path_factory, name: str, *args: str) -> StartedCli:
    """`megatron-rl drill NAME` on the tiny recipe in a fresh directory, started (`drill_record` reads it)."""
    run_dir = tmp_path_factory.mktemp(f"drill_{name}") / "run"
    return start_cli("drill", name, "--config", str(TINY), "--run-dir", str(run_dir), *args, check=False)


def drill_record(started: StartedCli) -> tuple[int, dict]:
    """A started drill's (exit code, its JSON record)."""
    proc = started.result()
    assert "{" in proc.stdout, proc.stderr[-4000:]
    return proc.returncode, last_json(proc.stdout)


def drill(tmp_path_factory, name: str, *args: str) -> tuple[int, dict]:
    """`megatron-rl drill NAME` on the tiny recipe in a fresh directory: (exit code, its JSON record)."""
    return drill_record(start_drill(tmp_path_factory, name, *args))


def drills_together(tmp_path_factory, names, *args) -> tuple[int, dict]:
    """One training run for the one-run drills `names` (`megatron-rl drill together`): (exit code, {drill: record})."""
    run_dir = tmp_path_factory.mktemp("drills_together") / "run"
    proc = run_cli("drill", "together", "--drills", ",".join(names), "--config", str(TINY), "--run-dir", str(run_dir),
                   *args, check=False)
    assert "{" in proc.stdout, proc.stderr[-4000:]
    result = last_json(proc.stdout)
    assert result["together"] == list(names) and sorted(result["records"]) == sorted(names), result
    return proc.returncode, result["records"]


def protocol_kept(record: dict, redone: int) -> None:
    """What every drill's record must show: nothing lost or duplicated, versions continuous, `redone` steps
    learned again, a measured recovery time."""
    assert record["trajectories_lost"] == 0, record
    assert record["trajectories_duplicated"] == 0, record
    assert record["versions_continuous"], record
    assert record["steps_redone"] == redone, record
    assert record["time_to_recover_s"] is not None and record["time_to_recover_s"] > 0, record


SYNC_DRILLS = {  # no fault timed against a clock, nothing read from timing: they may run beside each other
    "worker_crash": ("run.learner_timeout_s=60", "run.checkpoint_every=1", "run.keep_checkpoints=4"),
    "oom": (),
    "oom_twice": ("--at-step", "2", "--steps", "3"),
}


@pytest.fixture(scope="session")
def _sync_drills(request, tmp_path_factory):
    """The sync drills the selected tests read, two at a time (the second pair starts when a run of the first
    ends), all ended before the first of them is read: none runs on beside another module's runs."""
    names = [n for n in SYNC_DRILLS if wanted(request, n)]
    started: dict[str, StartedCli] = {}
    try:
        for name in names:
            running = [s for s in started.values() if s.running()]
            if len(running) >= 2:
                first_to_finish(*running)
            started[name] = start_drill(tmp_path_factory, name, *SYNC_DRILLS[name])
        for s in started.values():
            s.finish()
    finally:
        for s in started.values():
            s.kill()
    return started


def _sync_drill(started: dict, tmp_path_factory, name: str) -> tuple[int, dict]:
    return drill_record(started[name] if name in started else start_drill(tmp_path_factory, name, *SYNC_DRILLS[name]))


@pytest.fixture(scope="session")
def worker_crash(_sync_drills, tmp_path_factory):
    """The worker_crash drill with a checkpoint at every step: learner rank 0 SIGKILLed in step 3 of 4, the
    rerun resumed from step 2.  Its steps 1-4 are those of an uninterrupted run (resume is exact;
    tests/e2e/test_drills.py checks both), so tests/e2e/test_bad_checkpoint.py damages copies of it
    instead of training a run of its own: one start-up less in the suite.  Runs beside oom (`_sync_drills`)."""
    return _sync_drill(_sync_drills, tmp_path_factory, "worker_crash")


@pytest.fixture(scope="session")
def oom(_sync_drills, tmp_path_factory):
    """The oom drill: a fake OOM in step 3, retried at half the micro-batch (tests/e2e/test_drills.py)."""
    return _sync_drill(_sync_drills, tmp_path_factory, "oom")


@pytest.fixture(scope="session")
def oom_twice(_sync_drills, tmp_path_factory):
    """The oom_twice drill: OOM again at half the micro-batch in step 2, a clean stop, a rerun smaller."""
    return _sync_drill(_sync_drills, tmp_path_factory, "oom_twice")
