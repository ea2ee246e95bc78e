"""The suite's own plumbing: the durations table .ci/run ends with (tests/conftest.py), and which CLI runs
join the shared Ray cluster (tests/e2e/conftest.py) and carry their MEGATRON_RL_* settings to its workers
(train/run_setup.job_env_vars).

    python -m pytest tests/unit/test_suite_timing.py -q
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.train.run_setup import job_env_vars
from tests import conftest as suite
from tests import lanes
from tests.e2e import conftest as e2e

pytestmark = pytest.mark.unit


def test_a_test_id_belongs_to_the_folder_under_tests():
    assert suite.tier_of("tests/unit/test_loss.py::test_a") == "unit"
    assert suite.tier_of("tests/e2e/test_train.py::test_b[x-1]") == "e2e"
    assert suite.tier_of("tests/security/test_box.py::test_c") == "security"
    assert suite.tier_of("test_top.py::test_d") == "other"


def test_the_table_sums_each_tier_and_lists_the_slowest_first():
    seconds = {"tests/unit/a.py::t1": 1.0, "tests/unit/a.py::t2": 2.5, "tests/e2e/b.py::t3": 100.0,
               "tests/dist/c.py::t4": 30.0}
    outcome = {k: "passed" for k in seconds} | {"tests/dist/c.py::t4": "failed"}
    table = suite.durations_table(seconds, outcome, slowest=2).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:6]}
    assert rows["unit"] == ["2", "3.5", "0.1"] and rows["e2e"] == ["1", "100.0", "1.7"]
    assert rows["all"] == ["4", "133.5", "2.2"]
    assert [line.split()[0] for line in table[2:5]] == ["e2e", "dist", "unit"]  # the costliest tier first
    slowest = table[table.index("the 2 slowest tests:") + 1:]
    assert [line.split()[-1] for line in slowest] == ["tests/e2e/b.py::t3", "tests/dist/c.py::t4"]
    assert "failed" in slowest[1]


def test_each_worker_line_says_its_time_in_tests_when_it_ended_and_the_rest():
    lines = suite.worker_lines({"gw1": 600.0, "gw0": 1200.0}, {"gw0": 1500.0, "gw1": 2400.0})
    assert [line.split()[0] for line in lines] == ["gw0", "gw1"]
    assert "in tests  20.0 min" in lines[0] and "ended at  25.0 min" in lines[0] and "idle  5.0 min" in lines[0]
    assert "in tests  10.0 min" in lines[1] and "idle 30.0 min" in lines[1]
    waits = {"gw1": [(60.0, "tests/e2e/a.py::t"), (120.0, "tests/e2e/b.py::t"), (6.0, "tests/unit/c.py::t"),
                     (6.0, "tests/unit/d.py::t")]}
    lines = suite.worker_lines({"gw1": 600.0, "gw0": 1200.0}, {"gw0": 1500.0, "gw1": 2400.0}, waits)
    assert "lock" not in lines[0] and "waiting for the lanes lock  3.2 min" in lines[1]
    assert [line.split()[-1] for line in lines[2:]] == ["tests/e2e/b.py::t", "tests/e2e/a.py::t", "tests/unit/c.py::t"]


def test_cli_runs_that_start_ray_join_the_shared_cluster_unless_the_test_has_its_own(monkeypatch):
    monkeypatch.setattr(e2e.SHARED_RAY, "start", lambda: "10.0.0.1:6379")
    monkeypatch.setattr(e2e, "_OWN_RAY", [])  # a test without the marker (whatever e2e test ran last)
    monkeypatch.setenv("RAY_ADDRESS", "leaked:1")
    env, args = e2e.cli_env_and_args(("train", "--config", "c.yaml", "run.steps=2"))
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379" and args[-1] == "run.use_existing_ray=true"
    env, args = e2e.cli_env_and_args(("train", "--config", "c.yaml", "--dry-run"))  # a dry run starts no Ray
    assert "RAY_ADDRESS" not in env and "run.use_existing_ray=true" not in args
    env, args = e2e.cli_env_and_args(("convert", "mcore-to-hf", "--mcore", "x"))
    assert "RAY_ADDRESS" not in env and args == ("convert", "mcore-to-hf", "--mcore", "x")
    monkeypatch.setattr(e2e, "_OWN_RAY", [pytest.mark.own_ray("why")])
    env, args = e2e.cli_env_and_args(("drill", "oom", "--config", "c.yaml"))
    assert "RAY_ADDRESS" not in env and args == ("drill", "oom", "--config", "c.yaml")


def test_a_run_joining_a_cluster_hands_its_megatron_rl_settings_to_its_workers():
    environ = {"MEGATRON_RL_DRILL": '{"fault": "oom"}', "MEGATRON_RL_X": "1", "PATH": "/bin", "HOME": "/root"}
    assert job_env_vars(environ) == {"MEGATRON_RL_DRILL": '{"fault": "oom"}', "MEGATRON_RL_X": "1"}
    assert job_env_vars({"PATH": "/bin"}) == {}


class _Item:
    def __init__(self, nodeid: str, **marks) -> None:
        self.nodeid, self.marks = nodeid, {k: pytest.Mark(k, v, {}) for k, v in marks.items()}

    def get_closest_marker(self, name):
        return self.marks.get(name)


def test_a_module_is_one_group_unless_it_names_one_and_alone_excludes_the_engine_tiers():
    import fcntl

    assert lanes.group_of("tests/e2e/test_a.py::test_x[1]") == "tests/e2e/test_a.py"
    assert lanes.group_of("tests/e2e/test_bad_checkpoint.py::test_y") == lanes.group_of("tests/e2e/test_drills.py::t")
    assert lanes.lock_kind(_Item("tests/e2e/test_a.py::t", alone=("why",))) == fcntl.LOCK_EX
    assert lanes.lock_kind(_Item("tests/e2e/test_a.py::t")) == lanes.lock_kind(_Item("tests/dist/a.py::t")) \
        == fcntl.LOCK_SH
    assert lanes.lock_kind(_Item("tests/unit/a.py::t")) is None
    assert lanes.lock_kind(_Item("tests/security/a.py::t")) == fcntl.LOCK_EX  # wall-clock limits of seconds
    assert suite._test_id("tests/e2e/a.py::t@drills") == "tests/e2e/a.py::t"
    assert suite._test_id("tests/e2e/a.py::t[x@y]") == "tests/e2e/a.py::t[x@y]"


def test_groups_wait_alone_ones_first_then_by_tier_and_each_worker_writes_their_kinds(tmp_path):
    e2e, dist, unit, security = "tests/e2e/test_", "tests/dist/test_", "tests/unit/test_", "tests/security/test_"
    items = [_Item(unit + "u1.py::t"), _Item(e2e + "streaming.py::a", alone=("why",)),
             _Item(e2e + "streaming.py::b"), _Item(e2e + "train.py::t"), _Item(dist + "d.py::t"),
             _Item(unit + "u2.py::t"), _Item(e2e + "drills.py::t1"), _Item(e2e + "drills.py::t2", alone=("why",)),
             _Item(e2e + "bad_checkpoint.py::t"), _Item(security + "s.py::t"), _Item(unit + "u3.py::t")]
    order = [it.nodeid for it in lanes.hand_out_order(items)]
    assert order == [e2e + "streaming.py::a", e2e + "streaming.py::b",  # a group with an alone test, whole
                     e2e + "drills.py::t1", e2e + "drills.py::t2", e2e + "bad_checkpoint.py::t",  # one group
                     security + "s.py::t", e2e + "train.py::t", dist + "d.py::t",
                     unit + "u1.py::t", unit + "u2.py::t", unit + "u3.py::t"]
    kinds = lanes.group_kinds(items)
    assert kinds == {e2e + "streaming.py": "alone", "drills": "alone", security + "s.py": "alone",
                     e2e + "train.py": "shared", dist + "d.py": "shared",
                     unit + "u1.py": "light", unit + "u2.py": "light", unit + "u3.py": "light"}
    assert lanes.read_kinds(str(tmp_path)) == {}  # none written: every group light, the queue's order
    lanes.write_kinds(str(tmp_path), "gw1", kinds)
    assert lanes.read_kinds(str(tmp_path)) == kinds


def test_the_next_group_depends_on_what_the_other_worker_holds():
    kinds = {"a1": "alone", "a2": "alone", "s1": "shared", "s2": "shared", "l1": "light"}
    waiting = ["a1", "a2", "s1", "s2", "l1"]
    assert lanes.pick(waiting, kinds, set()) == "a1"  # nothing beside it: the exclusive work first
    assert lanes.pick(waiting, kinds, {"light"}) == "a1"
    assert lanes.pick(waiting, kinds, {"alone", "shared"}) == "l1"  # beside exclusive work: light work
    assert lanes.pick(["a2", "s1"], kinds, {"alone"}) == "a2"  # no light left: keep the exclusive work together
    assert lanes.pick(waiting, kinds, {"shared", "light"}) == "s1"  # engines beside engines
    assert lanes.pick(["a2", "l1"], kinds, {"shared"}) == "l1"
    assert lanes.pick(["a2"], kinds, {"shared"}) == "a2"
    assert lanes.pick(["x", "s1"], {}, {"shared"}) == "x"  # kinds unknown: the queue's order


def _two_workers(durations: dict[str, float], kinds: dict[str, str], choose) -> tuple[float, float]:
    """Wall time and seconds spent waiting for the lock of two workers taking groups as `choose(waiting,
    others)` says; an alone group starts only when the other worker holds no shared or alone group (and the
    reverse)."""
    waiting, free, holding, waited = list(durations), [0.0, 0.0], [("light", 0.0), ("light", 0.0)], 0.0
    while waiting:
        w = free.index(min(free))
        now, (other_kind, other_end) = free[w], holding[1 - w]
        group = choose(waiting, {other_kind} if other_end > now else set())
        waiting.remove(group)
        pair = {kinds[group], other_kind}
        start = max(now, other_end) if "alone" in pair and pair <= {"alone", "shared"} else now
        waited += start - now
        free[w], holding[w] = start + durations[group], (kinds[group], start + durations[group])
    return max(free), waited


def test_exclusive_groups_run_beside_light_work_instead_of_waiting_for_a_long_shared_group():
    """The last fresh-clone run's case: a worker handed an alone group waited 352 s for the other's long shared
    group.  With `pick`, the alone work runs beside the light work, and a worker waits only for the alone work
    that exceeds the light work; handed out in queue order (shared first, alone ones among the light), longer."""
    durations = {"s_long": 6.0, "s1": 1.0, "s2": 1.0, "a1": 3.0, "l1": 1.0, "a2": 2.0, "l2": 1.0, "l3": 1.0}
    kinds = {g: {"s": "shared", "a": "alone", "l": "light"}[g[0]] for g in durations}
    alone_s = sum(d for g, d in durations.items() if kinds[g] == "alone")
    light_s = sum(d for g, d in durations.items() if kinds[g] == "light")
    wall_fifo, waited_fifo = _two_workers(durations, kinds, lambda waiting, others: waiting[0])
    order = sorted(durations, key=lambda g: kinds[g] != "alone")  # hand_out_order's: alone groups first
    wall_pick, waited_pick = _two_workers({g: durations[g] for g in order}, kinds,
                                          lambda waiting, others: lanes.pick(waiting, kinds, others))
    assert waited_pick == pytest.approx(alone_s - light_s)
    assert waited_fifo >= waited_pick + 3.0
    assert wall_pick <= wall_fifo


def test_a_group_takes_its_lock_again_when_an_alone_test_follows_a_shared_one(tmp_path):
    import fcntl

    lock = lanes.GroupLock(str(tmp_path))
    lock.enter("g", fcntl.LOCK_SH)
    shared_fd = lock.fd
    lock.enter("g", fcntl.LOCK_SH)
    assert lock.fd == shared_fd  # the group's next shared test keeps it
    lock.enter("g", fcntl.LOCK_EX)
    probe = os.open(tmp_path / "lanes", os.O_RDWR)
    with pytest.raises(BlockingIOError):  # held exclusively now: no one else may share it
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    lock.leave()
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(probe)


def _enter_then_report(directory: str, kind: int, name: str, events) -> None:
    lock = lanes.GroupLock(directory)
    events.put(f"{name} asks")
    lock.enter(name, kind)
    events.put(f"{name} in")
    time.sleep(0.3)
    lock.leave()


def test_an_alone_group_waits_for_shared_holders_and_later_shared_ones_wait_for_it(tmp_path):
    """A shared holder (this process) keeps an exclusive one (child `ex`) out; a shared one that asks after
    `ex` began waiting (child `sh`) gets in only after `ex` (the turnstile), not beside the first holder."""
    import fcntl
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a forked child would share this process's lock (flock)
    events = ctx.Queue()
    held = lanes.GroupLock(str(tmp_path))
    held.enter("first", fcntl.LOCK_SH)
    ex = ctx.Process(target=_enter_then_report, args=(str(tmp_path), fcntl.LOCK_EX, "ex", events))
    ex.start()
    assert events.get(timeout=60) == "ex asks"
    time.sleep(0.5)
    sh = ctx.Process(target=_enter_then_report, args=(str(tmp_path), fcntl.LOCK_SH, "sh", events))
    sh.start()
    assert events.get(timeout=60) == "sh asks"
    time.sleep(0.5)
    assert events.empty()  # neither got in beside the first shared holder
    held.leave()
    order = [events.get(timeout=10), events.get(timeout=10)]
    ex.join(10), sh.join(10)
    assert order == ["ex in", "sh in"]
