"""Two tests at a time: how the suite runs on pytest-xdist workers (`launch/test.sh` passes `-n 2 --dist loadgroup`).

A run of the e2e tier spends about half its time waiting (Python, engine and learner start-ups, Ray, files),
so two workers on this machine's 2 cores finish it sooner.  What this plugin keeps right:

- **A module stays on one worker**, as its module- and session-scoped fixtures assume: each test gets the
  xdist group of its module, or the one its module names (`pytest.mark.xdist_group("...")`: modules that
  share a session fixture's run, e.g. test_drills.py and test_bad_checkpoint.py and `worker_crash`).
- **The heaviest tier goes first**: e2e, then dist, security, unit; within a tier, files keep their order.
  The unit tier's many small modules then even out the two workers' ends.
- **A test marked `alone("why")`** (one whose assertions read timing: armed faults, refits in flight) runs
  with no other e2e or dist test beside it: its group holds a lock the e2e and dist groups share, for the
  whole group (its runs can outlive one test).  Unit and security tests, which start no engines, may run
  beside it.  The lock lets a waiting `alone` group in before later shared holders (a turnstile).

Without xdist (a developer's `pytest tests/e2e/test_x.py`) nothing here changes how tests run, beyond the order.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

import pytest

TIER_ORDER = ("e2e", "dist", "security", "unit", "gpu")
SHARED_TIERS = ("e2e", "dist")  # tiers whose tests start engines, learners or gloo groups: never beside `alone`
LOCK_DIR = "MEGATRON_RL_TESTS_LOCK_DIR"  # set by the controller for its workers


def tier_of(nodeid: str) -> str:
    """The tier of a test id: the folder right under tests/ ('unit', 'dist', 'e2e', ...)."""
    parts = nodeid.replace("\\", "/").split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def group_of(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs["name"])
    return item.nodeid.split("::")[0]


def lock_kind(item) -> int | None:
    """flock's mode for the item's group: exclusive when marked `alone`, shared in the e2e and dist tiers."""
    if item.get_closest_marker("alone") is not None:
        return fcntl.LOCK_EX
    return fcntl.LOCK_SH if tier_of(item.nodeid) in SHARED_TIERS else None


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        config._lanes_dir = tempfile.mkdtemp(prefix="megatron-rl-lanes-")
        os.environ[LOCK_DIR] = config._lanes_dir  # the workers start after this and inherit it


def pytest_unconfigure(config):
    if getattr(config, "_lanes_dir", None):
        os.environ.pop(LOCK_DIR, None)
        shutil.rmtree(config._lanes_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(session, config, items):
    rank = {t: i for i, t in enumerate(TIER_ORDER)}
    items.sort(key=lambda it: rank.get(tier_of(it.nodeid), len(rank)))  # stable: files keep their order
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))


class GroupLock:
    """The lock one worker holds for the group it is running (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.group: str | None = None
        self.fd: int | None = None

    def _open(self, name: str) -> int:
        return os.open(os.path.join(self.directory, name), os.O_RDWR | os.O_CREAT, 0o600)

    def enter(self, group: str, kind: int | None) -> None:
        if group == self.group:
            return
        self.leave()
        self.group = group
        if kind is None:
            return
        turnstile = self._open("turnstile")
        try:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # a waiting exclusive holder keeps later shared ones out
            self.fd = self._open("lanes")
            fcntl.flock(self.fd, kind)
        finally:
            os.close(turnstile)  # closing releases the turnstile

    def leave(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.group, self.fd = None, None


_LOCK: list[GroupLock] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    directory = os.environ.get(LOCK_DIR)
    if directory is None or getattr(item.config, "workerinput", None) is None:
        yield
        return
    if not _LOCK:
        _LOCK.append(GroupLock(directory))
    lock = _LOCK[0]
    lock.enter(group_of(item), lock_kind(item))
    yield
    if nextitem is None or group_of(nextitem) != lock.group:  # the group's fixtures were torn down with item
        lock.leave()
