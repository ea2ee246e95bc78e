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
A trajectory is queued iff its `traj` row has no `done` row (matched by seq; the queue
keeps ids unique, so `traj.id` needs no index).  `position` counts commits; checkpoints
record it.  Compaction deletes the payloads of finished trajectories
(except those of the last `keep_takes` takes) and forgets finished ids once they are too
old to pass the version TTL again, so the file stays bounded.
"""

from __future__ import annotations

import json
import logging
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
"""


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
        row = self._db.execute("SELECT value FROM meta WHERE key='position'").fetchone()
        self.position = int(row[0]) if row else 0

    def load(self) -> WalState:
        db = self._db
        state = WalState(position=self.position)
        state.meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        state.queued = db.execute(
            "SELECT seq, id, enqueued_at, payload FROM traj "
            "WHERE seq NOT IN (SELECT seq FROM done WHERE seq IS NOT NULL) ORDER BY seq"
        ).fetchall()
        state.done = {tid: (v, outcome, reason, checksum) for tid, v, outcome, reason, checksum
                      in db.execute("SELECT id, min_version, outcome, reason, checksum FROM done")}
        for request_id, ids, probs in db.execute("SELECT request_id, ids, probs FROM takes ORDER BY pos"):
            state.takes.append((request_id, json.loads(ids), json.loads(probs)))
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
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT INTO traj (seq, id, enqueued_at, min_version, payload) VALUES (?, ?, ?, ?, ?)",
                           enqueued)
            db.executemany("INSERT OR REPLACE INTO done (id, seq, min_version, outcome, reason, request_id, "
                           "checksum) VALUES (?, ?, ?, ?, ?, ?, ?)", finished)
            if take is not None:
                request_id, ids, probs = take
                db.execute("INSERT INTO takes (request_id, pos, ids, probs) VALUES (?, ?, ?, ?)",
                           (request_id, self.position + 1, json.dumps(ids), json.dumps(probs)))
            items = dict(meta or {}, position=self.position + 1)
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in items.items()])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.position += 1
        return self.position

    def compact(self, *, current_version: int, max_version_lag: int, keep_takes: int) -> None:
        """Delete what replay no longer needs; later inserts reuse the freed pages."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM takes WHERE request_id NOT IN "
                       "(SELECT request_id FROM takes ORDER BY pos DESC LIMIT ?)", (keep_takes,))
            unreplayable = "(request_id IS NULL OR request_id NOT IN (SELECT request_id FROM takes))"
            n_payloads = db.execute("DELETE FROM traj WHERE seq IN (SELECT seq FROM done WHERE seq IS NOT NULL "
                                    f"AND {unreplayable})").rowcount
            # A finished id older than the version TTL would be dropped on arrival anyway.
            n_ids = db.execute(f"DELETE FROM done WHERE min_version < ? AND {unreplayable}",
                               (current_version - max_version_lag,)).rowcount
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        # Move the log's pages into the database so the next writes restart the -wal file.
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        logger.debug("WAL compaction: %d payloads and %d finished ids removed", n_payloads, n_ids)

    def count(self, table: str) -> int:
        if table not in ("traj", "done", "takes"):
            raise ValueError(f"unknown WAL table {table!r}")
        return self._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]

    def close(self) -> None:
        self._db.close()
