"""SQLite write-ahead log of the trajectory queue: durable before acknowledged.

    wal = WriteAheadLog("run/queue.db", synchronous="FULL")
    state = wal.load()                       # what the last process left behind
    wal.commit(enqueued=[row, ...], finished=[row, ...], take=(request_id, ids, probs), meta={...})
    wal.compact(current_version=7, max_version_lag=1, keep_takes=8)

One `commit` is one SQLite transaction, so a batch call (put_many, take) costs one commit.
The queue acknowledges only after `commit` returns.  Journal mode is WAL: a commit is one
sequential append to the -wal file (a rollback journal needs two fsyncs per commit).
`synchronous=FULL` (default) fsyncs that append at every commit, so an acknowledged
trajectory or consumption survives power loss; NORMAL skips it and only guarantees survival
of a process kill (the OS still holds the pages); both pass the SIGKILL test.

Tables:
    traj  (seq, id, enqueued_at, min_version, payload)  every accepted trajectory's bytes
    done  (id, seq, min_version, outcome, reason, request_id, checksum)  consumed or dropped ids
          (seq is NULL for a trajectory dropped on arrival, which has no traj row; checksum lets a
          re-sent id be told apart: same content = duplicate, other content = conflict)
    takes (request_id, pos, ids, probs)                 recent take batches, for replay
    meta  (key, value)                                  position, version, counters, admission
                                                        leases, priority-sampler RNG state
    kept  (id, payload)                                 consumed trajectories' bytes compaction kept
                                                        (coordinator.keep_consumed: what `replay` reads)
A trajectory is queued iff its `traj` row has no `done` row (matched by seq; the queue
keeps ids unique, so `traj.id` needs no index).  `position` counts commits; checkpoints
record it.  Compaction deletes the payloads of finished trajectories
(except those of the last `keep_takes` takes) and forgets finished ids once they are too
old to pass the version TTL again, so the file stays bounded.

A damaged log (a file that is not SQLite, or a record of the wrong shape) raises WalError naming
the file, table and record; the coordinator refuses to start on it rather than guess.  Only a
queued trajectory whose payload bytes are damaged is tolerated: replay drops it with a reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS traj (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, enqueued_at REAL NOT NULL,
                                 min_version INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS done (id TEXT PRIMARY KEY, seq INTEGER, min_version INTEGER NOT NULL,
                                 outcome TEXT NOT NULL, reason TEXT NOT NULL, request_id TEXT,
                                 checksum TEXT) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS done_request ON done (request_id);
CREATE TABLE IF NOT EXISTS takes (request_id TEXT PRIMARY KEY, pos INTEGER NOT NULL, ids TEXT NOT NULL,
                                  probs TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kept (id TEXT PRIMARY KEY, payload BLOB NOT NULL) WITHOUT ROWID;
"""


class WalError(ValueError):
    """The queue's log cannot be used (unreadable file, or a record of the wrong shape): the message names
    the file, the table and the record.  The coordinator refuses to start on it rather than guess, since
    a lost `done` row could let a trajectory be consumed twice; move the file aside to start empty."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


# The queue's meta keys and the check each value passes (absent keys take the queue's defaults).
_META_CHECKS = {
    "position": lambda v: _is_int(v) and v >= 0,
    "version": lambda v: _is_int(v) and v >= 0,
    "next_seq": lambda v: _is_int(v) and v >= 0,
    "counters": lambda v: isinstance(v, dict) and all(_is_num(x) for x in v.values()),
    "admission": lambda v: isinstance(v, dict) and isinstance(v.get("leases", {}), dict)
    and all(r is None or isinstance(r, str) for r in v.get("leases", {}).values())
    and all(_is_int(v.get(k, 0)) and v.get(k, 0) >= 0 for k in ("next_id", "expired")),
    "rng": lambda v: v is None or isinstance(v, dict),
    "lag_report": lambda v: v is None or (isinstance(v, dict) and _is_num(v.get("taken_dv_p95", 0.0))
                                          and (v.get("d_lag_p95") is None or _is_num(v["d_lag_p95"]))),
}


@dataclass
class WalState:
    """What `load` recovers: everything the queue needs to continue."""

    meta: dict = field(default_factory=dict)  # version, counters, next_seq, ...
    position: int = 0
    queued: list = field(default_factory=list)  # [(seq, id, enqueued_at, payload)] in seq order
    done: dict = field(default_factory=dict)  # id -> (min_version, outcome, reason, checksum)
    takes: list = field(default_factory=list)  # [(request_id, ids, probs)] oldest first
    payloads: dict = field(default_factory=dict)  # id -> payload, for ids in `takes`


class WriteAheadLog:
    def __init__(self, path: str | Path, *, synchronous: str = "FULL"):
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"coordinator.wal_path: directory {path.parent} does not exist")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL, got {synchronous!r}")
        self.path = path
        self._db = None
        try:
            self._open(path, synchronous)
        except BaseException as err:
            if self._db is not None:
                self._db.close()  # a refused file is not left open (nor locked)
            if isinstance(err, sqlite3.DatabaseError):
                raise WalError(f"coordinator.wal_path: {path} is not a readable queue log ({err})") from None
            raise

    def _open(self, path: Path, synchronous: str) -> None:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per batch.
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        # 16 KiB pages: a ~11 KB trajectory (1k tokens) fits one page, no overflow chain.
        self._db.execute("PRAGMA page_size=16384")  # only effective on a new file
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise ValueError(f"coordinator.wal_path: {path} cannot use WAL journal mode (got {mode!r}); "
                             "put it on a local filesystem")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA journal_size_limit=16777216")  # the -wal file shrinks back to <= 16 MiB
        self._db.executescript(_SCHEMA)
        if "checksum" not in [row[1] for row in self._db.execute("PRAGMA table_info(done)")]:
            self._db.execute("ALTER TABLE done ADD COLUMN checksum TEXT")  # a log written before it existed
        self.position = self._meta_value("position", (self._db.execute(
            "SELECT value FROM meta WHERE key='position'").fetchone() or ("0",))[0])

    def _bad(self, table: str, record, problem: str) -> WalError:
        return WalError(f"queue log {self.path}: {table} record {str(record)[:80]!r}: {problem}; the log is "
                        "damaged (move it aside to start with an empty queue)")

    def _meta_value(self, key, raw):
        try:
            value = json.loads(raw)
        except (TypeError, ValueError, RecursionError) as err:
            raise self._bad("meta", key, f"value is not JSON ({err!r})"[:200]) from None
        check = _META_CHECKS.get(key)
        if check is not None and not check(value):
            raise self._bad("meta", key, f"value {str(value)[:80]} is not of the expected shape")
        return value

    def load(self) -> WalState:
        """Read everything back; WalError (naming table and record) for a record of the wrong shape.

        A queued trajectory whose payload bytes are damaged is returned as is: the queue drops it
        on replay with a reason (it fails the trajectory checks)."""
        try:
            return self._load()
        except sqlite3.DatabaseError as err:
            raise WalError(f"queue log {self.path} is unreadable: {err}") from None

    def _load(self) -> WalState:
        db = self._db
        state = WalState(position=self.position)
        state.meta = {k: self._meta_value(k, v) for k, v in db.execute("SELECT key, value FROM meta")}
        state.queued = db.execute(
            "SELECT seq, id, enqueued_at, payload FROM traj "
            "WHERE seq NOT IN (SELECT seq FROM done WHERE seq IS NOT NULL) ORDER BY seq"
        ).fetchall()
        for seq, tid, enqueued_at, _ in state.queued:
            if not isinstance(tid, str) or not _is_num(enqueued_at):
                raise self._bad("traj", seq, f"id {tid!r} must be text and enqueued_at {enqueued_at!r} a number")
        for row in db.execute("SELECT id, seq, min_version, outcome, reason, checksum FROM done"):
            tid, seq, v, outcome, reason, checksum = row
            if not (isinstance(tid, str) and (seq is None or _is_int(seq)) and _is_int(v)
                    and outcome in ("consumed", "dropped") and isinstance(reason, str)
                    and (checksum is None or isinstance(checksum, str))):
                raise self._bad("done", tid, f"fields {row[1:]!r} are not (seq, min_version, outcome, reason, "
                                             "checksum)")
            state.done[tid] = (v, outcome, reason, checksum)
        queued_ids = [tid for _, tid, _, _ in state.queued]
        both = set(queued_ids) & set(state.done)
        if both or len(set(queued_ids)) != len(queued_ids):
            raise self._bad("traj", sorted(both)[0] if both else "?", "an id is queued twice, or queued and "
                                                                       "finished at once (its done row lost its seq)")
        for request_id, ids, probs in db.execute("SELECT request_id, ids, probs FROM takes ORDER BY pos"):
            try:
                ids, probs = json.loads(ids), json.loads(probs)
            except (TypeError, ValueError, RecursionError):
                ids = probs = None
            if not (isinstance(ids, list) and isinstance(probs, list) and len(ids) == len(probs)
                    and all(isinstance(i, str) for i in ids) and len(set(ids)) == len(ids)
                    and all(p is None or _is_num(p) for p in probs)):
                raise self._bad("takes", request_id, "ids and probs must be equal-length JSON lists")
            state.takes.append((request_id, ids, probs))
        state.payloads = dict(db.execute(
            "SELECT t.id, t.payload FROM traj t JOIN done d ON d.seq = t.seq "
            "WHERE d.request_id IN (SELECT request_id FROM takes)"
        ))
        logger.info("WAL %s: position %d, %d queued, %d finished ids, %d replayable takes",
                    self.path, self.position, len(state.queued), len(state.done), len(state.takes))
        return state

    def commit(
        self,
        *,
        enqueued: Iterable[tuple] = (),  # (seq, id, enqueued_at, min_version, payload)
        finished: Iterable[tuple] = (),  # (id, seq, min_version, outcome, reason, request_id, checksum)
        take: tuple | None = None,  # (request_id, ids, probs)
        meta: dict | None = None,
    ) -> int:
        """Write one batch atomically and durably; return the new log position."""
        db = self._db
        with self._transaction():
            db.executemany("INSERT INTO traj (seq, id, enqueued_at, min_version, payload) VALUES (?, ?, ?, ?, ?)",
                           enqueued)
            db.executemany("INSERT OR REPLACE INTO done (id, seq, min_version, outcome, reason, request_id, "
                           "checksum) VALUES (?, ?, ?, ?, ?, ?, ?)", finished)
            if take is not None:
                request_id, ids, probs = take
                # OR REPLACE: a take whose record could not be replayed is taken afresh under the same id.
                db.execute("INSERT OR REPLACE INTO takes (request_id, pos, ids, probs) VALUES (?, ?, ?, ?)",
                           (request_id, self.position + 1, json.dumps(ids), json.dumps(probs)))
            items = dict(meta or {}, position=self.position + 1)
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in items.items()])
        self.position += 1
        return self.position

    def compact(self, *, current_version: int, max_version_lag: int, keep_takes: int,
                keep_consumed: bool = False) -> None:
        """Delete what replay no longer needs; later inserts reuse the freed pages.  `keep_consumed`: the
        payloads of consumed trajectories move to `kept` first (a run's exact replay reads them)."""
        db = self._db
        with self._transaction():
            db.execute("DELETE FROM takes WHERE request_id NOT IN "
                       "(SELECT request_id FROM takes ORDER BY pos DESC LIMIT ?)", (keep_takes,))
            unreplayable = "(request_id IS NULL OR request_id NOT IN (SELECT request_id FROM takes))"
            if keep_consumed:
                db.execute("INSERT OR IGNORE INTO kept (id, payload) SELECT t.id, t.payload FROM traj t JOIN done d "
                           "ON t.seq = d.seq WHERE d.outcome = 'consumed' AND (d.request_id IS NULL OR d.request_id NOT IN "
                           "(SELECT request_id FROM takes))")
            n_payloads = db.execute("DELETE FROM traj WHERE seq IN (SELECT seq FROM done WHERE seq IS NOT NULL "
                                    f"AND {unreplayable})").rowcount
            # A finished id older than the version TTL would be dropped on arrival anyway.
            n_ids = db.execute(f"DELETE FROM done WHERE min_version < ? AND {unreplayable}",
                               (current_version - max_version_lag,)).rowcount
        # Move the log's pages into the database so the next writes restart the -wal file.
        with self._transaction(begin=False):
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        logger.debug("WAL compaction: %d payloads and %d finished ids removed", n_payloads, n_ids)

    @contextlib.contextmanager
    def _transaction(self, begin: bool = True):
        """One atomic write; a damaged database file surfaces as WalError naming it."""
        db = self._db
        try:
            if begin:
                db.execute("BEGIN IMMEDIATE")
            try:
                yield
                if begin:
                    db.execute("COMMIT")
            except BaseException:
                if begin:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
        except sqlite3.IntegrityError:
            raise  # a broken invariant of ours, not a damaged file
        except sqlite3.DatabaseError as err:
            raise WalError(f"queue log {self.path}: write failed ({err})") from None

    def count(self, table: str) -> int:
        if table not in ("traj", "done", "takes"):
            raise ValueError(f"unknown WAL table {table!r}")
        return self._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]

    def close(self) -> None:
        self._db.close()
