"""Property-based tests (hypothesis) of the queue invariants, in memory and with the WAL
(including restarts between operations):

  * no trajectory outside the requested version window is ever returned;
  * duplicates never double-count; a retried take (same request id) returns the same batch
    (unless the first returned nothing);
  * every valid trajectory offered ends exactly once: consumed, dropped (with a reason) or
    still queued; invalid ones are rejected and never stored or returned;
  * compaction (every 3 operations here) forgets only finished ids, a forgotten id re-sent
    (same content) is dropped by the version TTL rather than consumed again, and the log forgets
    what memory forgot (a restart does not bring an id back).  Each test asserts that
    compaction forgot ids in its examples: a run that never compacts fails.

    python -m pytest tests/unit/test_coordinator_props.py -q
"""

import collections
import dataclasses
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit
TOK = "c" * 64
LAG = 2


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def traj(idx, versions):
    r = len(versions)
    return make_trajectory(id=f"t{idx}", prompt_id=f"p{idx % 3}", dataset_version="d", policy_versions=versions,
                           tokenizer_hash=TOK, prompt_tokens=[1], response_tokens=[2] * r,
                           behavior_logprobs=[-0.5] * r, reward_components={"r": 1.0}, grader_version="g",
                           terminal_reason="eos", rollout_started_at=0.0, scored_at=0.0)


put_op = st.tuples(st.just("put"), st.lists(st.tuples(st.integers(0, 14), st.integers(0, 3), st.booleans(),
                                                      st.booleans()), min_size=1, max_size=5))
take_op = st.tuples(st.just("take"), st.integers(0, 4), st.one_of(st.none(), st.tuples(st.integers(0, 3),
                                                                                      st.integers(0, 3))),
                    st.one_of(st.none(), st.sampled_from(["r0", "r1", "r2"])))
version_op = st.tuples(st.just("version"), st.integers(0, 3))
tick_op = st.tuples(st.just("tick"), st.floats(0, 40))
restart_op = st.tuples(st.just("restart"))


COMPACT_EVERY = 3


def run_ops(ops, wal_path, stats, compact_every=COMPACT_EVERY):
    clock = Clock()
    cfg = CoordinatorConfig(batch_size=4, max_staleness=50, max_version_lag=LAG, max_age_s=60,
                            compact_every=compact_every, wal_path=wal_path)
    q = TrajectoryQueue(cfg, tokenizer_hash=TOK, clock=clock)
    offered, consumed, takes, first_checksum, first = set(), [], {}, {}, {}
    forgotten, redropped = set(), {}  # ids compaction forgot; re-sent ids the TTL dropped again (count)
    for op in list(ops) + ([("restart",)] if wal_path else []):  # WAL: always end with a restart
        if op[0] == "put":
            batch, bad_ids, corrupted, resent_forgotten = [], set(), set(), set()
            for idx, age, mixed, bad in op[1]:
                v = max(0, q.version - age)
                t = traj(idx, [v, min(v + 1, q.version)] if mixed else [v])
                if t.id in forgotten and not bad:  # a re-send after compaction: the same content
                    t = first[t.id]
                    resent_forgotten.add(t.id)
                if bad:  # a corrupted copy: wrong checksum
                    t = dataclasses.replace(t, response_tokens=t.response_tokens + 1)
                    bad_ids.add(t.id)
                    corrupted.add(len(batch))
                batch.append(t)
            known = {t.id for t in batch if q.outcome(t.id) is not None}
            accepted_before = q.metrics()["queue/accepted"]
            res = q.put_many(batch)
            for t in batch:
                if t.id in res.rejected:
                    assert res.rejected[t.id].startswith("checksum")
            assert set(res.accepted).isdisjoint(known)  # an id already known is never accepted again
            # A known id comes back as a duplicate if its content is what was first stored, else a conflict.
            resent = [t for t in batch if t.id in known and t.id not in bad_ids]
            assert set(res.duplicates) >= {t.id for t in resent if t.checksum == first_checksum[t.id]}
            assert set(res.conflicts) >= {t.id for t in resent if t.checksum != first_checksum[t.id]}
            assert q.metrics()["queue/accepted"] == accepted_before + len(res.accepted)
            for tid in resent_forgotten:  # forgotten, yet never consumed again: the TTL drops it
                assert tid not in res.accepted and res.dropped.get(tid) == "version_lag", (tid, res)
                forgotten.discard(tid)
                redropped[tid] = redropped.get(tid, 0) + 1
            for i, t in enumerate(batch):
                if i not in corrupted and (t.id in res.accepted or t.id in res.dropped):
                    first_checksum.setdefault(t.id, t.checksum)
                    first.setdefault(t.id, t)
            offered |= set(res.accepted) | {tid for tid in res.dropped if tid not in forgotten}
        elif op[0] == "take":
            _, n, window, request_id = op
            lo, hi = (q.version - LAG, q.version) if window is None else \
                (q.version - max(window), q.version - min(window))
            batch = q.take(n, min_version=lo, max_version=hi, request_id=request_id)
            ids = [t.id for t in batch]
            if request_id in takes:
                assert ids == takes[request_id]  # a retried take returns the same batch
                continue
            assert len(ids) <= n
            for t in batch:  # every token's policy version inside the window
                assert lo <= int(t.policy_versions.min()) and int(t.policy_versions.max()) <= hi
            consumed.extend(ids)
            if request_id is not None and ids:  # an empty take is not remembered: a retry takes afresh
                takes[request_id] = ids
        elif op[0] == "version":
            q.set_version(q.version + op[1])
        elif op[0] == "tick":
            clock.now += op[1]
        elif op[0] == "restart" and wal_path:
            q.close()
            q = TrajectoryQueue(cfg, tokenizer_hash=TOK, clock=clock)
            back = {tid for tid in forgotten if q.outcome(tid) is not None}
            stats["restarts_after_forgetting"] += bool(forgotten)
            assert not back, f"the log still held ids that compaction forgot in memory: {sorted(back)}"
        stats["forgotten"] += check_partition(q, offered, consumed, forgotten, redropped)
    q.close()


def check_partition(q, offered, consumed, forgotten, redropped):
    """Each offered id is in exactly one bucket; returns how many ids compaction newly forgot."""
    newly = 0
    assert len(consumed) == len(set(consumed)), "a trajectory was consumed twice"
    queued = set(q.queued_ids())
    assert queued <= offered
    for tid in offered:
        outcome = q.outcome(tid)
        if outcome is None:  # forgotten by compaction: only ever a finished id
            assert tid not in queued
            newly += tid not in forgotten
            forgotten.add(tid)
            continue
        assert tid not in forgotten, f"{tid} came back after compaction forgot it"
        if tid in redropped and outcome == "dropped/version_lag":
            continue  # its record is now the re-send's drop
        assert (outcome == "queued") == (tid in queued)
        assert (outcome == "consumed") == (tid in consumed), (tid, outcome)
        assert outcome in ("queued", "consumed") or outcome.startswith("dropped/"), (tid, outcome)
    m = q.metrics()
    dropped = sum(v for k, v in m.items() if k.startswith("queue/dropped/"))
    assert m["queue/consumed"] == len(consumed)
    assert len(offered) + sum(redropped.values()) == len(consumed) + len(queued) + dropped  # each exactly once
    return newly


def in_memory(stats, compact_every=COMPACT_EVERY):
    @settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.one_of(put_op, take_op, put_op, take_op, version_op, version_op, tick_op), min_size=4, max_size=30))
    def check(ops):
        run_ops(ops, "", stats, compact_every)
    return check


def with_wal(stats, compact_every=COMPACT_EVERY):
    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.one_of(put_op, take_op, put_op, take_op, version_op, version_op, tick_op, restart_op), min_size=4,
                    max_size=25))
    def check(ops):
        with tempfile.TemporaryDirectory() as tmp:
            run_ops(ops, str(Path(tmp) / "queue.db"), stats, compact_every)
    return check


def test_invariants_in_memory():
    stats = collections.Counter()
    in_memory(stats)()
    assert stats["forgotten"] > 0, "no example reached a compaction that forgot an id"


def test_invariants_with_wal_and_restarts():
    stats = collections.Counter()
    with_wal(stats)()
    assert stats["forgotten"] > 0, "no example reached a compaction that forgot an id"
    assert stats["restarts_after_forgetting"] > 0, "no example restarted from a log that compaction had cut"


def test_compaction_keeps_ids_of_replayable_takes_known(tmp_path):
    """Found by the property test once it reached compaction: the queue forgot a consumed id whose
    take the log still kept for replay; a re-send then overwrote its `done` row and, after a
    restart, the consumed trajectory was queued again (and could be consumed twice)."""
    cfg = CoordinatorConfig(batch_size=4, max_staleness=50, max_version_lag=LAG, compact_every=1,
                            wal_path=str(tmp_path / "queue.db"))
    q = TrajectoryQueue(cfg, tokenizer_hash=TOK)
    q.put(traj(0, [0]))
    assert [t.id for t in q.take(1, request_id="r0")] == ["t0"]
    q.set_version(3)  # compaction: t0 is past the TTL but its take "r0" is still replayable
    assert q.outcome("t0") == "consumed"
    assert q.put(traj(0, [0])).duplicates == ["t0"]  # the re-send is known, not judged afresh
    q.close()
    again = TrajectoryQueue(cfg, tokenizer_hash=TOK)
    assert again.queued_ids() == [] and again.outcome("t0") == "consumed"
    assert again.take(4, min_version=0, max_version=3) == []
    again.close()
