"""Fuzz (hypothesis) of the coordinator's WAL records: a damaged log gives WalError, nothing else.

    python -m pytest tests/unit/test_fuzz_wal.py -q

A real log is written by a TrajectoryQueue (puts, a take with a request id, a version bump),
then damaged, either record by record (one column of one row of traj / done / takes / meta set
to an arbitrary SQLite value: NULL, integer, real, text, blob, JSON) or byte by byte (the
database file itself).  Reopening must either raise WalError naming the file, or give a queue
that works: its metrics, a put, a take and a version bump run, and a trajectory whose payload
was damaged is dropped with a `replay_*` reason, never served.
"""

import json
import shutil
import sqlite3

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue, WalError
from megatron_rl.trajectory import make_trajectory
from tests.unit.fuzz_common import FUZZ, JSON_VALUES, mutate

pytestmark = pytest.mark.unit
TOK = "d" * 64
COLUMNS = {"traj": ["id", "enqueued_at", "min_version", "payload"],
           "done": ["seq", "min_version", "outcome", "reason", "request_id", "checksum"],
           "takes": ["pos", "ids", "probs"], "meta": ["value"]}


def traj(i, version=0):
    return make_trajectory(id=f"t{i}", prompt_id=f"p{i % 2}", dataset_version="d", policy_versions=version,
                           tokenizer_hash=TOK, prompt_tokens=[1, 2], response_tokens=[3, 4, 5],
                           behavior_logprobs=[-0.1, -0.2, -0.3], reward_components={"r": 1.0}, grader_version="g",
                           terminal_reason="eos", rollout_started_at=0.0, scored_at=0.0)


def config(path):
    return CoordinatorConfig(batch_size=4, max_staleness=100, max_version_lag=2, max_age_s=0, compact_every=10_000,
                             sampling="priority", wal_path=str(path))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("wal_template") / "queue.db"
    q = TrajectoryQueue(config(path), tokenizer_hash=TOK)
    q.try_admit(4, worker="w", request_id="adm-0")
    q.put_many([traj(i) for i in range(6)])
    q.take(3, request_id="step-0")
    q.set_version(1)
    q.put_many([traj(i, 1) for i in range(6, 9)])
    q.report_lag(dv_p95=0.5, d_lag_p95=0.01)
    q.close()
    return path


def reopen_and_use(path) -> None:
    try:
        q = TrajectoryQueue(config(path), tokenizer_hash=TOK)
    except WalError as err:
        assert str(path) in str(err)
        return
    try:
        for tid in q.queued_ids():
            assert q.outcome(tid) == "queued"
        q.metrics()
        q.put_many([traj(100, q.version)])
        served = q.take(4, request_id="step-1") + q.take(4, request_id="step-0")
        for t in served:
            assert t.tokenizer_hash == TOK and list(t.response_tokens) == [3, 4, 5]
        q.set_version(q.version + 1)
        q.compact()
    except WalError as err:  # a damaged page found by a later write
        assert str(path) in str(err)
    finally:
        q.close()


def sqlite_value():
    return st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=20),
                     st.binary(max_size=40), JSON_VALUES.map(json.dumps))


@FUZZ
@given(st.data())
def test_one_damaged_record(template, tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "wal_fuzz_record.db"
    shutil.copyfile(template, path)
    table = data.draw(st.sampled_from(sorted(COLUMNS)))
    column = data.draw(st.sampled_from(COLUMNS[table]))
    db = sqlite3.connect(str(path))
    rowids = [r[0] for r in db.execute(f"SELECT rowid FROM {table}")] if table in ("traj", "takes") else \
        [r[0] for r in db.execute(f"SELECT {'id' if table == 'done' else 'key'} FROM {table}")]
    key = data.draw(st.sampled_from(rowids))
    where = "rowid" if table in ("traj", "takes") else ("id" if table == "done" else "key")
    value = data.draw(sqlite_value())
    if column == "payload" and data.draw(st.booleans()):
        blob = db.execute("SELECT payload FROM traj WHERE rowid=?", (key,)).fetchone()[0]
        value = mutate(blob, data)
    try:
        db.execute(f"UPDATE {table} SET {column}=? WHERE {where}=?", (value, key))
        db.commit()
    except sqlite3.IntegrityError:
        pass  # NOT NULL / primary key: SQLite itself refuses this damage
    db.close()
    reopen_and_use(path)


@FUZZ
@given(st.data())
def test_damaged_database_file(template, tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "wal_fuzz_file.db"
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    blob = template.read_bytes()
    for _ in range(data.draw(st.integers(1, 4))):
        blob = mutate(blob, data)
    path.write_bytes(blob)
    reopen_and_use(path)


# ------------------------------------------------------------------ regressions (found by the fuzz)

@pytest.mark.parametrize("sql, args, match", [
    ("UPDATE meta SET value=? WHERE key='position'", ("1.5",), "position"),  # int('1.5'): ValueError
    ("UPDATE meta SET value=? WHERE key='version'", ('"7"',), "version"),  # compared with ints later
    ("UPDATE meta SET value=? WHERE key='counters'", ("[1]",), "counters"),  # Counter.update(list)
    ("UPDATE meta SET value=? WHERE key='admission'", ('{"leases": [1]}',), "admission"),  # AttributeError
    ("UPDATE meta SET value=? WHERE key='rng'", ('{"bit_generator": "PCG64", "state": 1}',), "rng"),
    ("UPDATE meta SET value=? WHERE key='next_seq'", ("{",), "not JSON"),  # JSONDecodeError
    ("UPDATE done SET min_version=? WHERE id=(SELECT MIN(id) FROM done)", ("old",), "done"),
    ("UPDATE takes SET ids=?", ("not json",), "takes"),
    ("UPDATE traj SET enqueued_at=? WHERE seq=(SELECT MAX(seq) FROM traj)", ("soon",), "enqueued_at"),
])
def test_regressions_are_wal_errors(template, tmp_path, sql, args, match):
    path = tmp_path / "queue.db"
    shutil.copyfile(template, path)
    db = sqlite3.connect(str(path))
    db.execute(sql, args)
    db.commit()
    db.close()
    with pytest.raises(WalError, match=match):
        TrajectoryQueue(config(path), tokenizer_hash=TOK)


def test_damaged_payloads_are_dropped_with_a_reason_not_served(template, tmp_path):
    path = tmp_path / "queue.db"
    shutil.copyfile(template, path)
    db = sqlite3.connect(str(path))
    db.execute("UPDATE traj SET payload=? WHERE id='t7'", (12345,))  # memoryview(int) raised TypeError
    db.execute("UPDATE traj SET payload=(SELECT payload FROM traj WHERE id='t6') WHERE id='t8'")  # wrong id
    db.commit()
    db.close()
    q = TrajectoryQueue(config(path), tokenizer_hash=TOK)
    assert q.outcome("t7") == "dropped/replay_schema" and q.outcome("t8") == "dropped/replay_schema"
    served = {t.id for t in q.take(10)}  # 3 of t0..t5 were taken before, t7 and t8 are dropped
    assert len(served) == 4 and "t6" in served and not served & {"t7", "t8"}
    q.close()


def test_a_file_that_is_not_a_database_is_a_wal_error(tmp_path):
    path = tmp_path / "queue.db"
    path.write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(WalError, match="not a readable queue log"):
        TrajectoryQueue(config(path), tokenizer_hash=TOK)
