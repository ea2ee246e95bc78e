"""Coordinator state that must survive a restart, and content-checked idempotency (issue #15).

    python -m pytest tests/unit/test_coordinator_durability.py -q

Admission leases and the priority sampler's RNG live in the WAL (a restarted queue on the same
file continues with them); an expired lease is revoked so a late trajectory cannot push
accepted + running past the admission bound; a known id re-sent with other content is a
conflict, not a duplicate.
"""

import dataclasses

import pytest

from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue
from tests.unit.test_coordinator import TOK, Clock, traj

pytestmark = pytest.mark.unit


def open_queue(path, clock=None, **cfg):
    return TrajectoryQueue(CoordinatorConfig(wal_path=str(path), **cfg), tokenizer_hash=TOK, clock=clock or Clock())


def test_admission_leases_survive_a_restart_on_the_same_wal(tmp_path):
    db = tmp_path / "q.db"
    q = open_queue(db, batch_size=4, max_staleness=1)  # one_step_off: bound (1 + 0 + 1) * 4 = 8
    leases = q.try_admit(8)
    assert len(leases) == 8
    q.close()  # the coordinator dies right after admitting two rounds

    q = open_queue(db, batch_size=4, max_staleness=1)
    assert q.metrics()["queue/running"] == 8
    assert q.try_admit(4) == []  # before the fix: running restarted at 0 and a third round was admitted
    res = q.put_many([traj(i) for i in range(4)], lease_ids=leases[:4])
    assert len(res.accepted) == 4 and q.metrics()["queue/running"] == 4
    assert q.try_admit(4) == []
    q.set_version(1)
    granted = q.try_admit(4, request_id="round-2")
    assert len(granted) == 4
    q.close()
    q = open_queue(db, batch_size=4, max_staleness=1)  # a retried admission gets the first call's grant
    assert q.try_admit(4, request_id="round-2") == granted and q.metrics()["queue/running"] == 8
    q.close()


def test_lease_expiry_never_lets_accepted_plus_running_exceed_the_bound():
    clock = Clock()
    q = TrajectoryQueue(CoordinatorConfig(batch_size=4, max_staleness=0, lease_ttl_s=10), tokenizer_hash=TOK,
                        clock=clock)
    slow = q.try_admit(4)  # a long round ...
    clock.now += 11  # ... outlives its leases: the slots are freed
    fresh = q.try_admit(4)
    assert len(fresh) == 4 and q.metrics()["queue/leases_expired"] == 4
    late = q.put_many([traj(i) for i in range(4)], lease_ids=slow)  # the slow round arrives after all
    assert late.accepted == [] and set(late.dropped.values()) == {"lease_expired"}
    assert q.metrics()["queue/capacity"] >= 0  # = bound - (accepted + running)
    on_time = q.put_many([traj(i) for i in range(4, 8)], lease_ids=fresh)
    assert len(on_time.accepted) == 4
    assert q.metrics()["queue/capacity"] == 0
    assert q.admission_bound() == (4, 4)
    assert q.metrics()["queue/dropped/lease_expired"] == 4


def test_lease_clocks_restart_after_a_restart(tmp_path):
    clock = Clock()
    db = tmp_path / "q.db"
    q = open_queue(db, clock, batch_size=2, max_staleness=0, lease_ttl_s=10)
    leases = q.try_admit(2)
    q.close()
    clock.now += 60  # down for longer than the TTL: time spent dead does not expire anyone's lease
    q = open_queue(db, clock, batch_size=2, max_staleness=0, lease_ttl_s=10)
    assert len(q.put_many([traj(0), traj(1)], lease_ids=leases).accepted) == 2
    q.close()


def test_priority_sampler_rng_is_restored_from_the_wal(tmp_path):
    cfg = dict(batch_size=3, sampling="priority", max_version_lag=100, seed=7)
    items = [traj(i, priority=1.0 + i % 5) for i in range(24)]

    def takes(db, restart_after):
        q = open_queue(db, **cfg)
        q.put_many(items)
        got = []
        for k in range(5):
            if k == restart_after:
                q.close()
                q = open_queue(db, **cfg)
            got.append([t.id for t in q.take(3, request_id=f"step-{k}")])
        q.close()
        return got

    uninterrupted = takes(tmp_path / "a.db", restart_after=None)
    restarted = takes(tmp_path / "b.db", restart_after=2)
    assert restarted == uninterrupted


def test_same_id_other_content_is_a_conflict_not_a_duplicate(tmp_path):
    db = tmp_path / "q.db"
    q = open_queue(db, max_version_lag=100)
    original = traj(0)
    other = dataclasses.replace(traj(0, prompt="p-other"), id=original.id)
    assert other.checksum != original.checksum
    assert q.put(original).accepted == ["t0"]
    again = q.put(original)
    assert again.duplicates == ["t0"]
    clash = q.put(other)
    assert clash.duplicates == [] and clash.accepted == [] and clash.conflicts == ["t0"]
    assert again.conflicts == []
    assert q.take(1)[0].checksum == original.checksum  # the stored content is the first one
    assert q.put(other).conflicts == ["t0"]  # also once consumed
    q.close()
    q = open_queue(db, max_version_lag=100)  # and after a restart (the checksum is in the log)
    assert q.put(other).conflicts == ["t0"] and q.put(original).duplicates == ["t0"]
    m = q.metrics()
    assert m["queue/conflicts"] == 3 and m["queue/duplicates"] == 2
    q.close()


def test_a_renewed_lease_outlives_its_ttl():
    clock = Clock()
    q = TrajectoryQueue(CoordinatorConfig(batch_size=2, max_staleness=0, lease_ttl_s=10), tokenizer_hash=TOK,
                        clock=clock)
    leases = q.try_admit(2)
    for _ in range(3):  # a round that takes 3 x 8 s, its producer alive and beating
        clock.now += 8
        assert q.renew(leases) == 2
    assert q.try_admit(2) == [] and q.metrics()["queue/leases_expired"] == 0
    assert len(q.put_many([traj(0), traj(1)], lease_ids=leases).accepted) == 2
    assert q.renew(leases) == 0  # completed leases are no longer live
