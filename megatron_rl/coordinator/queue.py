"""TrajectoryQueue: the coordinator's logic, in one plain (single-threaded) Python class.

    q = TrajectoryQueue(CoordinatorConfig(batch_size=64, wal_path="run/queue.db"), tokenizer_hash=h)
    leases = q.try_admit(8, worker="rollout-0")      # may start 8 rollouts
    res = q.put_many(trajs, lease_ids=leases)         # durable when it returns
    batch = q.take(64, request_id="step-12")          # retrying "step-12" returns the same batch
    q.set_version(13); q.metrics()["queue/dv_p95"]

Every trajectory offered to `put_many` ends in exactly one bucket: rejected (broke the
contract; reason returned and counted, never stored), duplicate (its id was seen with the
same checksum: no-op), conflict (its id was seen with OTHER content: counted as
queue/conflicts, logged, never stored), dropped (TTL, quota, or its admission lease expired;
reason recorded), queued, and later consumed (exactly once) or dropped by TTL.  With
`wal_path` set every state change is committed to the SQLite log in one transaction per call
before the call returns, and a new queue on the same file resumes where the last one stopped
(TTL re-evaluated), admission leases and the priority sampler's RNG state included (both are
in the log's meta, so a checkpoint's queue snapshot holds them).  `actor.py` wraps this class
in Ray.

The queue composes its parts, each in its own module: admission leases (admission.py) and
backpressure on staleness (backpressure.py: admission's eta falls to 0 while a signal is past
its limit), per-prompt/source quotas and the PutResult buckets (intake.py), TTL eviction
(eviction.py), FIFO/priority sampling with its durable RNG (sampling.py), finished ids and
replayable takes (ledger.py), the log (wal.py) and decoding it on restore (replay.py).

Version lag (dv) is measured from a trajectory's OLDEST per-token policy version.
Compaction forgets a finished id once its oldest version lags the learner by more than
`max_version_lag`; a copy re-sent after that is still never consumed: the version TTL drops
it on arrival (counted as dropped/version_lag rather than as a duplicate).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Callable, Sequence

import numpy as np

from megatron_rl.coordinator.admission import Admission
from megatron_rl.coordinator.backpressure import Backpressure, BackpressureSignals, percentile
from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.coordinator.eviction import QueuedEntry, drop_reason, evict
from megatron_rl.coordinator.intake import PutResult, Quotas
from megatron_rl.coordinator.ledger import Ledger
from megatron_rl.coordinator.replay import queued_trajectories, replayable_takes
from megatron_rl.coordinator.sampling import PrioritySampler, with_sampling_probabilities
from megatron_rl.coordinator.wal import WalState, WriteAheadLog
from megatron_rl.trajectory import Trajectory, TrajectoryError, validate, verify_checksum

__all__ = ["Backpressure", "PutResult", "TrajectoryQueue"]

logger = logging.getLogger(__name__)


class TrajectoryQueue:
    def __init__(self, config: CoordinatorConfig, *, tokenizer_hash: str, clock: Callable[[], float] = time.time):
        if not isinstance(tokenizer_hash, str) or not tokenizer_hash:
            raise ValueError(f"tokenizer_hash must be a non-empty str, got {tokenizer_hash!r}")
        self.config = config
        self.tokenizer_hash = tokenizer_hash
        self._clock = clock
        self._sampler = PrioritySampler(sampling=config.sampling, priority_alpha=config.priority_alpha,
                                        seed=config.seed)
        self._admission = Admission(batch_size=config.batch_size, lease_ttl_s=config.lease_ttl_s, clock=clock)
        self._queue: dict[str, QueuedEntry] = {}  # id -> entry, in seq (arrival) order
        self._ledger = Ledger(take_replay_window=config.take_replay_window)  # finished ids, recent takes
        self._counters: collections.Counter = collections.Counter()
        self._version = 0
        self._next_seq = 0
        self._position = 0
        self._since_compact = 0
        self._starving = False
        self._signals = BackpressureSignals(config)
        self._wal = WriteAheadLog(config.wal_path, synchronous=config.wal_synchronous) if config.wal_path else None
        if self._wal is not None:
            try:
                self._restore(self._wal.load())
            except BaseException:
                self.close()  # refused: release the file
                raise

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        return self._version

    @property
    def position(self) -> int:
        """Log position (number of committed batch operations); checkpoints record it."""
        return self._position

    def __len__(self) -> int:
        return len(self._queue)

    def queued_ids(self) -> list[str]:
        return list(self._queue)

    def outcome(self, traj_id: str) -> str | None:
        """'queued', 'consumed', 'dropped/<reason>', or None (never seen, or forgotten by compaction)."""
        if traj_id in self._queue:
            return "queued"
        return self._ledger.outcome(traj_id)

    # ------------------------------------------------------------- admission
    def try_admit(self, n: int, *, worker: str = "", request_id: str | None = None) -> list[str]:
        """Grant up to n rollout slots; returns their lease ids (possibly none), durable when returned.

        With `request_id`, a retried call returns the leases the first one granted.
        """
        eta = self.admission_staleness()
        accepted = self._counters["consumed"] + len(self._queue)
        with self._atomic():
            before = self._admission.running
            expired = self._admission.expire()
            leases = self._admission.admit(n, eta=eta, version=self._version, accepted=accepted, worker=worker,
                                           request_id=request_id)
            if expired or self._admission.running != before:
                self._commit()
        return leases

    def release(self, lease_ids: Sequence[str]) -> None:
        """Give back slots of rollouts that will not produce a trajectory."""
        with self._atomic():
            self._admission.release(lease_ids)
            self._commit()

    def renew(self, lease_ids: Sequence[str]) -> int:
        """Heartbeat of a live rollout: its leases do not expire; returns how many were still live.

        Not logged: lease clocks restart on a restore anyway."""
        return self._admission.renew(lease_ids)

    def admission_staleness(self) -> int:
        """The eta admission uses now: max_staleness, or 0 while throttled by backpressure."""
        return self._signals.eta(self.backpressure())

    def report_lag(self, *, dv_p95: float, d_lag_p95: float | None = None) -> None:
        """The learner's lag on its last batch: P95 of its version lag dv and of D_lag over sequences.

        Past coordinator.backpressure_taken_dv_p95 / backpressure_d_lag_p95 it turns backpressure on
        until a later report falls back under the limit.  Logged (when a limit is set), so a restart
        keeps it."""
        saved = self._signals.lag_report
        self._signals.lag_report = {"taken_dv_p95": float(dv_p95),
                                    "d_lag_p95": None if d_lag_p95 is None else float(d_lag_p95)}
        if not self._signals.reads_lag_report:
            return
        try:
            self._commit()
        except BaseException:
            self._signals.lag_report = saved
            raise

    def admission_bound(self) -> tuple[int, int]:
        """(accepted + running, (max_staleness + v + 1) * B): admission keeps the first <= the second
        (backpressure only admits less: it can hold the first above its throttled bound, never this one)."""
        accepted = self._counters["consumed"] + len(self._queue)
        bound = (self.config.max_staleness + self._version + 1) * self.config.batch_size
        return accepted + self._admission.running, bound

    def set_version(self, version: int) -> None:
        """The learner published policy `version` (monotonic); re-applies the version TTL."""
        if not isinstance(version, int) or version < self._version:
            raise ValueError(f"set_version: version must be an int >= current {self._version}, got {version!r}")
        with self._atomic():
            self._version = version
            self._commit(finished=self._ttl_drops())
        self._maybe_compact(force=False)

    # ------------------------------------------------------------------- put
    def put(self, traj: Trajectory, lease_id: str | None = None) -> PutResult:
        return self.put_many([traj], None if lease_id is None else [lease_id])

    def put_many(self, trajs: Sequence[Trajectory], lease_ids: Sequence[str | None] | None = None) -> PutResult:
        """Validate, deduplicate, apply TTL and quotas, log durably, then acknowledge."""
        if lease_ids is not None and len(lease_ids) != len(trajs):
            raise ValueError(f"put_many: {len(lease_ids)} lease ids for {len(trajs)} trajectories")
        now = self._clock()
        self._admission.expire()  # a lease past its TTL is revoked before its trajectory is judged
        result = PutResult()
        new: dict[str, QueuedEntry] = {}
        blobs: dict[str, bytes] = {}
        finished: list[tuple] = []  # (id, seq, min_version, outcome, reason, request_id, checksum)
        quotas = Quotas(self.config, (e.traj for e in self._queue.values()))
        seen: dict[str, str | None] = {}  # id -> checksum, for ids first met in this call
        for i, traj in enumerate(trajs):
            screened = self._screen(traj, seen, result)
            if screened is None:
                continue
            (oldest, newest), blob = screened
            entry = QueuedEntry(traj, self._next_seq + len(new), now, oldest, newest)
            reason = self._arrival_drop_reason(entry, None if lease_ids is None else lease_ids[i], quotas, now)
            if reason is not None:
                result.dropped[traj.id] = reason
                finished.append((traj.id, None, entry.min_version, "dropped", reason, None, traj.checksum))
                continue
            quotas.add(traj)
            new[traj.id], blobs[traj.id] = entry, blob
        rows = [(e.seq, tid, e.enqueued_at, e.min_version, blobs[tid]) for tid, e in new.items()] \
            if self._wal is not None else []
        with self._atomic():
            finished.extend(self._ttl_drops())
            self._next_seq += len(new)
            self._queue.update(new)
            self._counters["accepted"] += len(new)
            self._counters.update(f"status/{e.traj.status}" for e in new.values())
            for lid in lease_ids or ():  # the rollout is over, whatever became of its trajectory
                self._admission.complete(lid)
            result.position = self._commit(enqueued=rows, finished=finished)
        result.accepted = list(new)
        self._maybe_compact(force=False)
        return result

    def _screen(self, traj: Trajectory, seen: dict, result: PutResult) -> tuple | None:
        """((oldest, newest) versions, log bytes) of a new trajectory that keeps the contract; None (and
        `result` told why) for one rejected, a duplicate or a conflict."""
        try:
            versions = validate(traj, tokenizer_hash=self.tokenizer_hash, current_version=self._version,
                                check_checksum=False)
            blob = traj.to_bytes() if self._wal is not None else None
            verify_checksum(traj, blob)
        except TrajectoryError as err:
            result.rejected[str(getattr(traj, "id", None))] = str(err)
            self._counters[f"rejected/{err.reason}"] += 1
            logger.warning("rejected trajectory: %s", err)
            return None
        known = self._known_checksum(traj.id, seen)
        if known is False:
            seen[traj.id] = traj.checksum
            return versions, blob
        if known is None or known == traj.checksum:
            result.duplicates.append(traj.id)
            self._counters["duplicates"] += 1
        else:
            result.conflicts.append(traj.id)
            self._counters["conflicts"] += 1
            logger.error("conflict: trajectory id %s was already seen with checksum %s, now offered "
                         "with %s; the new content is not stored", traj.id, known, traj.checksum)
        return None

    def _arrival_drop_reason(self, entry: QueuedEntry, lease: str | None, quotas: Quotas, now: float) -> str | None:
        if lease is not None and not self._admission.is_live(lease):
            return "lease_expired"  # its slot may have been granted again: accepting it could break the bound
        return drop_reason(entry, version=self._version, now=now, config=self.config) or quotas.reason(entry.traj)

    def _known_checksum(self, tid: str, seen: dict) -> str | None | bool:
        """The checksum an already-known id was offered with (None if not recorded); False if unknown."""
        if tid in seen:
            return seen[tid]
        if tid in self._queue:
            return self._queue[tid].traj.checksum
        return self._ledger.checksum(tid)

    # ------------------------------------------------------------------ take
    def take(self, n: int, *, min_version: int | None = None, max_version: int | None = None,
             request_id: str | None = None) -> list[Trajectory]:
        """Consume up to n trajectories whose every token's policy version is in [min_version, max_version].

        The window defaults to [version - max_version_lag, version].  With `request_id`, a
        retried call (e.g. after a coordinator or learner restart) returns the same batch.
        """
        replayed = self._ledger.replay(request_id)
        if replayed is not None:
            return replayed
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"take: n must be an int >= 0, got {n!r}")
        lo = self._version - self.config.max_version_lag if min_version is None else min_version
        hi = self._version if max_version is None else max_version
        if lo > hi:
            raise ValueError(f"take: empty version window [{lo}, {hi}]")
        with self._atomic():
            finished = self._ttl_drops()
            eligible = [e for e in self._queue.values() if lo <= e.min_version and e.max_version <= hi
                        and e.traj.tokenizer_hash == self.tokenizer_hash]
            chosen, probs = self._sampler.choose(eligible, n)
            batch = with_sampling_probabilities([e.traj for e in chosen], probs)
            ids = [t.id for t in batch]
            finished.extend((e.traj.id, e.seq, e.min_version, "consumed", "", request_id, e.traj.checksum)
                            for e in chosen)
            for tid in ids:
                del self._queue[tid]
            self._counters["consumed"] += len(ids)
            # An empty take consumed nothing: a retry with the same request id may take afresh.
            take = (request_id, ids, probs) if request_id is not None and ids else None
            self._commit(finished=finished, take=take)
        self._starving = len(batch) < n
        self._maybe_compact(force=False)
        if take is not None:
            self._ledger.remember_take(request_id, batch)
        return batch

    def _ttl_drops(self) -> list[tuple]:
        """Remove queued trajectories past a TTL; return their `done` rows for the next commit."""
        return evict(self._queue, version=self._version, now=self._clock(), config=self.config)

    # ------------------------------------------------------------ durability
    @contextlib.contextmanager
    def _atomic(self):
        """Undo in-memory changes if the log commit fails: nothing is acknowledged, nothing lost."""
        saved = (dict(self._queue), collections.Counter(self._counters), self._next_seq, self._version,
                 self._admission.state_dict(), self._sampler.state)
        try:
            yield
        except BaseException:
            self._queue, self._counters, self._next_seq, self._version = saved[:4]
            self._admission.load_state_dict(saved[4])
            self._sampler.state = saved[5]
            raise

    def _commit(self, *, enqueued=(), finished=(), take=None) -> int:
        for _, _, _, outcome, reason, _, _ in finished:
            if outcome == "dropped":
                self._counters[f"dropped/{reason}"] += 1
        if self._wal is not None:
            meta = {"version": self._version, "next_seq": self._next_seq, "counters": dict(self._counters),
                    "admission": self._admission.state_dict(), "rng": self._sampler.state,
                    "lag_report": self._signals.lag_report}
            self._position = self._wal.commit(enqueued=enqueued, finished=finished, take=take, meta=meta)
        else:
            self._position += 1
        self._ledger.record(finished)
        for tid, _, _, outcome, reason, _, _ in finished:
            if outcome == "dropped":
                logger.info("dropped trajectory %s: %s", tid, reason)
        return self._position

    def _maybe_compact(self, *, force: bool) -> None:
        self._since_compact += 1
        if not force and self._since_compact < self.config.compact_every:
            return
        self._since_compact = 0
        self._ledger.forget(floor=self._version - self.config.max_version_lag)
        if self._wal is not None:
            self._wal.compact(current_version=self._version, max_version_lag=self.config.max_version_lag,
                              keep_takes=self.config.take_replay_window, keep_consumed=self.config.keep_consumed)

    def compact(self) -> None:
        """Compact now (also happens every `compact_every` logged operations)."""
        self._maybe_compact(force=True)

    def _restore(self, state: WalState) -> None:
        self._version = int(state.meta.get("version", 0))
        self._next_seq = int(state.meta.get("next_seq", 0))
        self._counters.update(state.meta.get("counters", {}))
        self._position = state.position
        self._ledger.load(state.done)
        self._admission.load_state_dict(state.meta.get("admission", {}))
        self._signals.lag_report.update(state.meta.get("lag_report") or {})
        self._sampler.restore(state.meta.get("rng"), wal_path=self.config.wal_path)
        queued, corrupt = queued_trajectories(state, tokenizer_hash=self.tokenizer_hash)
        for seq, tid, enqueued_at, traj in queued:
            self._queue[tid] = QueuedEntry(traj, seq, enqueued_at, traj.oldest_version, int(traj.policy_versions.max()))
        for request_id, batch in replayable_takes(state):
            self._ledger.remember_take(request_id, batch)
        n_queued = len(self._queue)
        with self._atomic():
            self._commit(finished=corrupt + self._ttl_drops())
        logger.info("coordinator restored from %s at version %d: %d queued (%d dropped by TTL on replay)",
                    self.config.wal_path, self._version, len(self._queue), n_queued - len(self._queue))

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None

    # --------------------------------------------------------------- metrics
    def _lags_and_ages(self) -> tuple[np.ndarray, np.ndarray]:
        now = self._clock()
        entries = self._queue.values()
        dv = np.fromiter((self._version - e.min_version for e in entries), np.float64, len(self._queue))
        age = np.fromiter((now - e.enqueued_at for e in entries), np.float64, len(self._queue))
        return dv, age

    def backpressure(self) -> Backpressure:
        dv, age = self._lags_and_ages()
        return self._signals.judge(dv, age, starving=self._starving)

    def metrics(self) -> dict[str, float]:
        """Gauges and cumulative counters, keys grouped under queue/."""
        dv, age = self._lags_and_ages()
        bp = self.backpressure()
        eta = self.admission_staleness()
        accepted = self._counters["consumed"] + len(self._queue)
        out = {"queue/depth": float(len(self._queue)), "queue/version": float(self._version),
               "queue/running": float(self._admission.running), "queue/log_position": float(self._position),
               "queue/leases_expired": float(self._admission.expired),
               "queue/capacity": float(self._admission.capacity(eta=eta, version=self._version, accepted=accepted)),
               **self._signals.metrics(bp, eta)}
        waits = np.array(self._admission.waits, dtype=np.float64)
        for name, values in (("age_s", age), ("dv", dv), ("admission_wait_s", waits)):
            for q in (50, 95, 99):
                out[f"queue/{name}_p{q}"] = percentile(values, q)
        for name in ("accepted", "consumed", "duplicates", "conflicts", "dropped/version_lag", "dropped/max_age"):
            out[f"queue/{name}"] = 0.0
        out.update({f"queue/{k}": float(v) for k, v in self._counters.items()})
        return out
