"""Two tests at a time: how the suite runs on pytest-xdist workers (`bash launch/test.sh` passes `-n 2 --dist
loadfile`; with MEGATRON_RL_TEST_WORKERS=1, or a plain `pytest`, one test at a time, and this plugin changes nothing).

A run of the e2e tier spends about half its time waiting (Python, engine and learner start-ups, Ray, files),
so two workers on this machine's 2 cores finish it sooner.  What this plugin keeps right:

- **A module stays on one worker**, as its module- and session-scoped fixtures assume, and so do modules
  that share a session fixture's run (SHARED_GROUPS: test_drills.py and test_bad_checkpoint.py read
  `worker_crash`).  The scheduler is xdist's loadfile with these groups as its scopes (xdist's own
  `xdist_group` marks are lost on pytest 9: xdist 3.8 renames a node id pytest no longer reads back).
- **A test marked `alone("why")`** (one whose assertions read timing: armed faults, refits in flight) runs
  with no other e2e or dist test beside it: it holds a lock the e2e and dist tests share (a readers-writer
  flock; a waiting `alone` test goes before later shared holders, a turnstile).  A group keeps its lock from
  test to test (a module's runs outlive the test that started them), so a module whose fixtures' runs read
  timing is marked as a whole.  Unit and security tests, which start no engines, may run beside it.
- **Which group a worker gets next** (`pick`, called by the scheduler ModuleGroups): it depends on what the other
  worker holds.  Beside a shared (e2e, dist) group, another shared one; beside a light (unit) one, or nothing, a
  group with an `alone` test, so that the exclusive work runs while the other worker has light work to do; beside an
  `alone` group, a light one, else the next `alone` group (the exclusive work stays together at the front of the
  suite instead of waiting at its end for a long shared group to finish).  The workers write each group's kind
  (ALONE, SHARED, LIGHT) when they collect (the controller sees only test ids); hand_out_order gives the order
  within a kind.

Measured on this suite's machine (2 cores, the same day): 46.3 min on two workers against 61.6 on one; each
e2e test stretched about 1.6x (their start-ups already overlap: tests/e2e/conftest.py start_cli).  That run's
security tests hit their wall-clock limits (the tier runs alone since); the next fresh-clone run on two workers
passed whole (tests/README.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time

import pytest

TIER_ORDER = ("e2e", "dist", "security", "unit", "gpu")
SHARED_TIERS = ("e2e", "dist")  # tiers whose tests start engines, learners or gloo groups: never beside `alone`
QUIET_TIERS = ("security",)  # its sandboxed snippets run under wall-clock limits of seconds: alone, as if marked
LOCK_DIR = "MEGATRON_RL_TESTS_LOCK_DIR"  # set by the controller for its workers
LOCK_WAIT = "lanes_lock_wait_s"  # a test's user property: seconds its worker waited for the lock before it
WAIT_REPORTED_S = 0.5
KINDS_FILE = "group-kinds-{}.json"  # written by each worker at collection, read by the controller's scheduler
ALONE, SHARED, LIGHT = "alone", "shared", "light"  # a group: has an exclusive test / takes the shared lock / none
PREFERENCE = {  # the kind the other worker holds -> the kinds to hand out, best first (module docstring)
    ALONE: (LIGHT, ALONE, SHARED),
    SHARED: (SHARED, LIGHT, ALONE),
    LIGHT: (ALONE, SHARED, LIGHT),
}


def tier_of(nodeid: str) -> str:
    """The tier of a test id: the folder right under tests/ ('unit', 'dist', 'e2e', ...)."""
    parts = nodeid.replace("\\", "/").split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


SHARED_GROUPS = {  # module -> the group it shares with others: one worker runs them, in order
    "tests/e2e/test_bad_checkpoint.py": "drills",  # reads the session fixture worker_crash of ...
    "tests/e2e/test_drills.py": "drills",
}


def group_of(nodeid: str) -> str:
    """The scope a worker runs whole: the test's module, or the group SHARED_GROUPS puts it in."""
    module = nodeid.split("::")[0]
    return SHARED_GROUPS.get(module, module)


def lock_kind(item) -> int | None:
    """flock's mode for the item's group: exclusive when marked `alone` (or in a quiet tier), shared in the e2e and
    dist tiers."""
    if item.get_closest_marker("alone") is not None or tier_of(item.nodeid) in QUIET_TIERS:
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


def pytest_collection_modifyitems(session, config, items):
    workerinput = getattr(config, "workerinput", None)
    if not config.getoption("numprocesses", None) and workerinput is None:
        return  # under xdist only: one worker keeps the folders' order
    kinds = group_kinds(items)
    items[:] = hand_out_order(items, kinds)
    if workerinput is not None and os.environ.get(LOCK_DIR):
        write_kinds(os.environ[LOCK_DIR], workerinput.get("workerid", "gw"), kinds)


def _groups(items: list) -> dict[str, list]:
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    return groups


def group_kinds(items: list) -> dict[str, str]:
    """Each group's kind: ALONE when a test of it holds the lock exclusively, SHARED when it shares it, else LIGHT."""
    kinds = {}
    for g, its in _groups(items).items():
        held = {lock_kind(it) for it in its}
        kinds[g] = ALONE if fcntl.LOCK_EX in held else SHARED if fcntl.LOCK_SH in held else LIGHT
    return kinds


def hand_out_order(items: list, kinds: dict[str, str] | None = None) -> list:
    """The order groups wait in: the groups with an `alone` test, then the other e2e groups, dist, security,
    unit.  `pick` takes the first group of the kind it wants.  Within a group, tests keep their file
    order; groups of one tier keep their collection order."""
    groups, kinds = _groups(items), kinds or group_kinds(items)

    def key(g: str) -> tuple:
        tier = tier_of(groups[g][0].nodeid)
        return (kinds[g] != ALONE, TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER))

    return [item for g in sorted(groups, key=key) for item in groups[g]]


def write_kinds(directory: str, worker: str, kinds: dict[str, str]) -> None:
    path = os.path.join(directory, KINDS_FILE.format(worker))
    with open(path + ".tmp", "w") as f:
        json.dump(kinds, f)
    os.replace(path + ".tmp", path)  # whole or absent for the controller


def read_kinds(directory: str | None) -> dict[str, str]:
    """The kinds a worker wrote ({} when none did: every group then counts as LIGHT, xdist's own order)."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("group-kinds-") and n.endswith(".json")) \
        if directory and os.path.isdir(directory) else []
    if not names:
        return {}
    with open(os.path.join(directory, names[0])) as f:
        return json.load(f)


def pick(waiting: list[str], kinds: dict[str, str], others: set[str]) -> str:
    """The group to hand out from `waiting` (in queue order) to a worker while the other workers hold groups
    of the kinds `others` (module docstring)."""
    held = ALONE if ALONE in others else SHARED if SHARED in others else LIGHT
    for kind in PREFERENCE[held]:
        for group in waiting:
            if kinds.get(group, LIGHT) == kind:
                return group
    return waiting[0]


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with group_of's scopes: a module, or a group of modules, goes to one worker whole."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleGroups(LoadFileScheduling):
        kinds: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if self.kinds is None:  # every worker has collected (and written its kinds) before the first call
                self.kinds = read_kinds(os.environ.get(LOCK_DIR))
            others = {self.kinds.get(group, LIGHT) for other, work in self.assigned_work.items() if other is not node
                      for group, tests in work.items() if not all(tests.values())}
            self.workqueue.move_to_end(pick(list(self.workqueue), self.kinds, others), last=False)
            super()._assign_work_unit(node)

    return ModuleGroups(config, log)


class GroupLock:
    """The lock one worker holds for the group it is running (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.group: str | None = None
        self.kind: int | None = None
        self.fd: int | None = None

    def _open(self, name: str) -> int:
        return os.open(os.path.join(self.directory, name), os.O_RDWR | os.O_CREAT, 0o600)

    def enter(self, group: str, kind: int | None) -> None:
        """Hold `kind` for `group`: kept from the group's last test when the same, else taken again (an
        `alone` test inside a group whose other tests share)."""
        if group == self.group and kind == self.kind:
            return
        self.leave()
        self.group, self.kind = group, kind
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
        self.group, self.kind, self.fd = None, None, None


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
    asked = time.monotonic()
    lock.enter(group_of(item.nodeid), lock_kind(item))
    waited = time.monotonic() - asked
    if waited >= WAIT_REPORTED_S:  # travels with the test's reports to the controller (tests/conftest.py)
        item.user_properties.append((LOCK_WAIT, waited))
    yield
    if nextitem is None or group_of(nextitem.nodeid) != lock.group:  # the group's fixtures were torn down with item
        lock.leave()
