"""TrajectoryQueue durability: SQLite WAL replay, TTL on replay, commit failure, compaction.

    python -m pytest tests/unit/test_coordinator_wal.py -q
"""

import sqlite3

import numpy as np
import pytest

from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit
TOK = "d" * 64


class Clock:
    def __init__(self):
        self.now = 5000.0

    def __call__(self):
        return self.now


def traj(i, version=0, tokens=8):
    return make_trajectory(id=f"t{i}", prompt_id=f"p{i % 3}", dataset_version="d", policy_versions=version,
                           tokenizer_hash=TOK, prompt_tokens=np.arange(tokens), response_tokens=np.arange(tokens),
                           behavior_logprobs=-np.ones(tokens), reward_components={"r": float(i)},
                           grader_version="g", terminal_reason="eos", rollout_started_at=0.0, scored_at=0.0)


def open_queue(path, clock=None, **cfg):
    cfg.setdefault("max_staleness", 100)
    return TrajectoryQueue(CoordinatorConfig(wal_path=str(path), **cfg), tokenizer_hash=TOK, clock=clock or Clock())


def test_restart_restores_queued_never_consumed(tmp_path):
    db = tmp_path / "q.db"
    q = open_queue(db, max_version_lag=5)
    q.put_many([traj(i) for i in range(6)])
    batch = q.take(2, request_id="step-0")
    q.set_version(1)
    q.put(traj(0))  # duplicate of a consumed id
    position, metrics = q.position, q.metrics()
    q.close()  # nothing is flushed at close: every call was durable already

    q = open_queue(db, max_version_lag=5)
    assert q.queued_ids() == ["t2", "t3", "t4", "t5"] and q.version == 1
    assert q.outcome("t0") == "consumed" and q.position > position
    assert [t.id for t in q.take(2, request_id="step-0")] == [t.id for t in batch]  # replayed, not re-consumed
    assert q.put_many([traj(1), traj(2)]).duplicates == ["t1", "t2"]
    assert [t.id for t in q.take(10)] == ["t2", "t3", "t4", "t5"]
    m = q.metrics()
    assert m["queue/consumed"] == 6 and m["queue/duplicates"] == metrics["queue/duplicates"] + 2


def test_ttl_is_reevaluated_on_replay(tmp_path):
    db = tmp_path / "q.db"
    clock = Clock()
    q = open_queue(db, clock, max_age_s=100)
    q.put(traj(0))
    clock.now += 60
    q.put(traj(1))
    q.close()
    clock.now += 50  # t0 is now 110 s old, t1 50 s
    q = open_queue(db, clock, max_age_s=100)
    assert q.queued_ids() == ["t1"] and q.outcome("t0") == "dropped/max_age"
    assert q.metrics()["queue/dropped/max_age"] == 1


def test_corrupt_payload_is_dropped_on_replay_with_reason(tmp_path):
    db = tmp_path / "q.db"
    q = open_queue(db)
    q.put_many([traj(0), traj(1)])
    q.close()
    con = sqlite3.connect(db)
    payload = bytearray(con.execute("SELECT payload FROM traj WHERE id='t1'").fetchone()[0])
    payload[-20] ^= 0xFF  # flip bits inside the arrays
    con.execute("UPDATE traj SET payload=? WHERE id='t1'", (bytes(payload),))
    con.commit()
    con.close()
    q = open_queue(db)
    assert q.queued_ids() == ["t0"] and q.outcome("t1") == "dropped/replay_checksum"


def test_failed_commit_acknowledges_nothing_and_loses_nothing(tmp_path, monkeypatch):
    q = open_queue(tmp_path / "q.db")
    q.put(traj(0))
    real_commit = q._wal.commit

    def disk_full(**kwargs):  # injected failure: the log cannot be written
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(q._wal, "commit", disk_full)
    with pytest.raises(sqlite3.OperationalError):
        q.put(traj(1))
    with pytest.raises(sqlite3.OperationalError):
        q.take(1, request_id="s")
    assert q.queued_ids() == ["t0"] and q.outcome("t1") is None and q.metrics()["queue/consumed"] == 0
    monkeypatch.setattr(q._wal, "commit", real_commit)
    assert q.put(traj(1)).accepted == ["t1"]  # the producer's retry goes through
    assert [t.id for t in q.take(2, request_id="s")] == ["t0", "t1"]


def test_log_is_compacted_and_stays_bounded(tmp_path):
    db = tmp_path / "q.db"
    q = open_queue(db, max_staleness=1, max_version_lag=1, compact_every=4, take_replay_window=2)
    sizes = []
    for step in range(60):
        q.put_many([traj(step * 8 + i, version=step, tokens=256) for i in range(8)])
        assert len(q.take(8, request_id=f"step-{step}")) == 8
        q.set_version(step + 1)
        disk = db.stat().st_size + (tmp_path / "q.db-wal").stat().st_size
        sizes.append((disk, q._wal.count("traj"), q._wal.count("done")))
    # payloads kept: the 2 replayable takes plus what accumulated since the last compaction
    assert max(s[1] for s in sizes[10:]) <= 2 * 8 + 4 * 8
    assert max(s[2] for s in sizes[10:]) <= 3 * 8 + 4 * 8
    assert max(s[0] for s in sizes[30:]) <= max(s[0] for s in sizes[:30])  # the files stop growing
    assert sizes[-1][0] < 60 * 8 * len(traj(0, tokens=256).to_bytes())  # far below everything written
    q.close()
    q = open_queue(db, max_staleness=1, max_version_lag=1, take_replay_window=2)
    assert [t.id for t in q.take(8, request_id="step-59")] == [f"t{59 * 8 + i}" for i in range(8)]


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        open_queue(tmp_path / "nope" / "q.db")


@pytest.mark.parametrize("keep", [False, True])
def test_keep_consumed_keeps_every_consumed_payload_through_compaction_for_replay(tmp_path, keep):
    """coordinator.keep_consumed (issue 47, exact replay): compaction moves consumed payloads to `kept`
    instead of deleting them; without it they are gone; dropped ones are never kept; restart is unchanged."""
    from megatron_rl.replay import load_trajectories

    db = tmp_path / "q.db"
    q = open_queue(db, max_staleness=1, max_version_lag=1, compact_every=2, take_replay_window=1,
                   keep_consumed=keep)
    consumed = []
    for step in range(6):
        q.put_many([traj(10 * step + i, version=step) for i in range(4)])
        consumed += [t.id for t in q.take(3, request_id=f"step-{step}")]
        q.set_version(step + 1)
    q.compact()
    queued = q.queued_ids()
    q.close()
    found = load_trajectories(db, set(consumed))
    if keep:
        assert set(found) == set(consumed)
        assert all(found[i].id == i for i in consumed)
        with sqlite3.connect(db) as c:
            kept = {row[0] for row in c.execute("SELECT id FROM kept")}
        assert kept <= set(consumed)  # never a dropped or queued one
    else:
        assert len(found) < len(consumed) / 2  # compaction dropped most consumed payloads
    q = open_queue(db, max_staleness=1, max_version_lag=1, keep_consumed=keep)
    assert q.queued_ids() == queued  # kept payloads are not queued again on restart
    q.close()
