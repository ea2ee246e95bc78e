"""The parts both rollout producers hold (sampling/producer_parts.py): asking for admissions, keeping the leases
alive, giving back what a checkpoint interrupts; the background thread's pause and error.

    python -m pytest tests/unit/test_producer_parts.py -q

The coordinator here is a test double of its admission calls (try_admit, renew, release, wait/wake).
"""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.sampling.producer_parts import Leases, ProducerThread

pytestmark = pytest.mark.unit


class Admission:
    """Grants from a script of grant sizes (then refuses); records renewals and releases."""

    def __init__(self, grants: list[int], ttl: float = 60.0) -> None:
        self.config = type("C", (), {"lease_ttl_s": ttl})()
        self.grants, self.serial = list(grants), 0
        self.asked: list[tuple[int, str]] = []
        self.renewed: list[list[str]] = []
        self.released: list[str] = []
        self.admission_epoch = 0

    def try_admit(self, n, *, worker, request_id):
        self.asked.append((n, request_id))
        k = min(n, self.grants.pop(0)) if self.grants else 0
        self.serial += k
        return [f"l{self.serial - k + i}" for i in range(k)]

    def renew(self, leases):
        self.renewed.append(list(leases))

    def release(self, leases):
        self.released += leases

    def wait_admission(self, epoch, timeout):
        time.sleep(0.01)


def test_admit_asks_again_for_the_rest_with_a_fresh_request_id_until_all_are_granted():
    coord = Admission([3, 0, 5])
    leases = Leases(coord, quit=lambda: False)
    assert leases.admit(8, round_=4) == [f"l{i}" for i in range(8)]
    assert coord.asked == [(8, "round-4/0"), (5, "round-4/1"), (5, "round-4/2")]
    assert leases.held == {f"l{i}" for i in range(8)}


def test_at_least_takes_a_grant_short_of_the_need_once_that_many_are_in_hand():
    leases = Leases(Admission([2, 3]), quit=lambda: False)
    assert leases.admit(6, round_=0, prefix="group", at_least=2) == ["l0", "l1"]


def test_a_checkpoint_interrupting_an_admission_gets_the_partial_grant_back():
    coord, quit = Admission([3]), threading.Event()
    leases = Leases(coord, quit=quit.is_set)
    got: list = []
    asker = threading.Thread(target=lambda: got.append(leases.admit(8, round_=1)))
    asker.start()
    while not coord.asked or len(coord.asked) < 2:
        time.sleep(0.01)
    quit.set()
    asker.join(5)
    assert got == [None]
    assert coord.released == ["l0", "l1", "l2"] and leases.held == set()


def test_the_keepalive_renews_what_is_held_and_the_batch_just_handed_out():
    coord, stopping = Admission([4], ttl=0.06), threading.Event()
    leases = Leases(coord, quit=lambda: False)
    granted = leases.admit(4, round_=0)
    leases.hand_out(granted[:2])
    leases.keep_alive(stopping)
    deadline = time.monotonic() + 5
    while not coord.renewed and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping.set()
    leases.keepalive.join(5)
    assert coord.renewed and coord.renewed[0] == ["l0", "l1", "l2", "l3"]
    leases.hand_out(granted[2:])  # the next batch: the first two are the driver's now (enqueued)
    assert sorted(leases.held.union(leases.handed)) == ["l2", "l3"]


def test_pause_waits_for_work_in_flight_and_raises_the_error_the_thread_died_of():
    loop = ProducerThread("t")
    loop.busy = True
    woken: list = []
    done: list = []
    pauser = threading.Thread(target=lambda: done.append(loop.pause(lambda: woken.append(1), lambda: loop.busy)))
    pauser.start()
    pauser.join(0.3)
    assert pauser.is_alive() and loop.paused and loop.quit_asked() and woken == [1]
    with loop.cond:
        loop.busy = False
        loop.cond.notify_all()
    pauser.join(5)
    assert done == [None]
    loop.unpause()
    assert not loop.quit_asked()
    loop.fail(ValueError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        loop.pause(lambda: None, lambda: True)
