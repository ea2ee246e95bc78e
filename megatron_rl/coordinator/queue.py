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

Backpressure on staleness slows the producer through admission, before any sample is
generated, instead of letting stale samples be generated and then dropped.  It is on while
any signal is past its limit: the P95 of dv or of age over QUEUED trajectories
(backpressure_dv_p95, backpressure_age_p95_s), or what the learner reported with
`report_lag` after its last step: the P95 of dv over the batch it took
(backpressure_taken_dv_p95) and its D_lag P95 (learn/d_lag/p95, backpressure_d_lag_p95).
With backpressure_reaction 'throttle' admission then uses eta 0 instead of max_staleness (no
round admitted ahead of the learner's version), and max_staleness again once every signal is
back under its limit; 'report' only raises the signal.  Each on/off transition is logged;
metrics: queue/backpressure (0/1), queue/backpressure_taken_dv, queue/backpressure_d_lag
(which learner signal), queue/admission_eta (the eta in force).  The learner's report is in
the log's meta, so a restored queue (or a resumed run) admits as before.  In sync mode eta is
already 0: backpressure changes nothing there.

Version lag (dv) is measured from a trajectory's OLDEST per-token policy version.
Compaction forgets a finished id once its oldest version lags the learner by more than
`max_version_lag`; a copy re-sent after that is still never consumed: the version TTL drops
it on arrival (counted as dropped/version_lag rather than as a duplicate).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_rl.coordinator.admission import Admission
from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.coordinator.wal import WalError, WalState, WriteAheadLog
from megatron_rl.trajectory import Trajectory, TrajectoryError, validate, verify_checksum

logger = logging.getLogger(__name__)


@dataclass
class PutResult:
    """What happened to each trajectory of one put_many call (by id)."""

    accepted: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)
    conflicts: list = field(default_factory=list)  # ids already known with a different checksum
    rejected: dict = field(default_factory=dict)  # id -> "reason: message"
    dropped: dict = field(default_factory=dict)  # id -> reason
    position: int = 0  # log position after the call


@dataclass
class Backpressure:
    active: bool  # dv P95 or age P95 over its threshold
    reasons: list  # which thresholds are exceeded
    starving: bool  # the last take got fewer trajectories than it asked for
    dv_p95: float
    age_p95_s: float


@dataclass
class _Entry:
    traj: Trajectory
    seq: int
    enqueued_at: float
    min_version: int
    max_version: int


class TrajectoryQueue:
    def __init__(self, config: CoordinatorConfig, *, tokenizer_hash: str, clock: Callable[[], float] = time.time):
        if not isinstance(tokenizer_hash, str) or not tokenizer_hash:
            raise ValueError(f"tokenizer_hash must be a non-empty str, got {tokenizer_hash!r}")
        self.config = config
        self.tokenizer_hash = tokenizer_hash
        self._clock = clock
        self._rng = np.random.default_rng(config.seed)
        self._admission = Admission(batch_size=config.batch_size, lease_ttl_s=config.lease_ttl_s, clock=clock)
        self._queue: dict[str, _Entry] = {}  # id -> entry, in seq (arrival) order
        self._done: dict[str, tuple] = {}  # finished id -> (oldest policy version, outcome label, checksum)
        self._takes: collections.OrderedDict[str, list] = collections.OrderedDict()  # request id -> batch
        self._counters: collections.Counter = collections.Counter()
        self._version = 0
        self._next_seq = 0
        self._position = 0
        self._since_compact = 0
        self._starving = False
        self._lag_report: dict = {"taken_dv_p95": 0.0, "d_lag_p95": None}  # the learner's last report_lag
        self._bp_active = False
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
        done = self._done.get(traj_id)
        return None if done is None else done[1]

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
        bp = self.backpressure()
        if bp.active != self._bp_active:  # log each transition once
            self._bp_active = bp.active
            if bp.active:
                logger.warning("backpressure on (%s): dv_p95 %.3g, age_p95 %.3g s, taken dv_p95 %.3g, d_lag_p95 %s; %s",
                               ", ".join(bp.reasons), bp.dv_p95, bp.age_p95_s, self._lag_report["taken_dv_p95"],
                               self._lag_report["d_lag_p95"],
                               "admitting no round ahead of the learner (eta 0)"
                               if self.config.backpressure_reaction == "throttle" else "reporting only")
            else:
                logger.info("backpressure off: admitting up to max_staleness %d rounds ahead",
                            self.config.max_staleness)
        if self.config.backpressure_reaction == "throttle" and bp.active:
            return 0
        return self.config.max_staleness

    def report_lag(self, *, dv_p95: float, d_lag_p95: float | None = None) -> None:
        """The learner's lag on its last batch: P95 of its version lag dv and of D_lag over sequences.

        Past coordinator.backpressure_taken_dv_p95 / backpressure_d_lag_p95 it turns backpressure on
        until a later report falls back under the limit.  Logged (when a limit is set), so a restart
        keeps it."""
        saved = dict(self._lag_report)
        self._lag_report = {"taken_dv_p95": float(dv_p95), "d_lag_p95": None if d_lag_p95 is None else float(d_lag_p95)}
        if self.config.backpressure_taken_dv_p95 is None and self.config.backpressure_d_lag_p95 is None:
            return  # no limit reads it: not worth a log write per step
        try:
            self._commit()
        except BaseException:
            self._lag_report = saved
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
        new: dict[str, _Entry] = {}
        finished: list[tuple] = []  # (id, seq, min_version, outcome, reason, request_id, checksum)
        per_prompt = collections.Counter(e.traj.prompt_id for e in self._queue.values()) \
            if self.config.max_queued_per_prompt else None
        per_source = collections.Counter(e.traj.source for e in self._queue.values()) \
            if self.config.max_queued_per_source else None
        blobs: dict[str, bytes] = {}
        seen: dict[str, str | None] = {}  # id -> checksum, for ids first met in this call
        for i, traj in enumerate(trajs):
            try:
                oldest, newest = validate(traj, tokenizer_hash=self.tokenizer_hash, current_version=self._version,
                                          check_checksum=False)
                blob = traj.to_bytes() if self._wal is not None else None
                verify_checksum(traj, blob)
            except TrajectoryError as err:
                tid = getattr(traj, "id", None)
                result.rejected[str(tid)] = str(err)
                self._counters[f"rejected/{err.reason}"] += 1
                logger.warning("rejected trajectory: %s", err)
                continue
            tid = traj.id
            known = self._known_checksum(tid, seen)
            if known is not False:
                if known is None or known == traj.checksum:
                    result.duplicates.append(tid)
                    self._counters["duplicates"] += 1
                else:
                    result.conflicts.append(tid)
                    self._counters["conflicts"] += 1
                    logger.error("conflict: trajectory id %s was already seen with checksum %s, now offered "
                                 "with %s; the new content is not stored", tid, known, traj.checksum)
                continue
            seen[tid] = traj.checksum
            entry = _Entry(traj, self._next_seq + len(new), now, oldest, newest)
            lease = lease_ids[i] if lease_ids is not None else None
            reason = None
            if lease is not None and not self._admission.is_live(lease):
                reason = "lease_expired"  # its slot may have been granted again: accepting it could break the bound
            if reason is None:
                reason = self._drop_reason(entry, now)
            if reason is None and per_prompt is not None:
                reason = "quota_prompt" if per_prompt[traj.prompt_id] >= self.config.max_queued_per_prompt else None
            if reason is None and per_source is not None:
                reason = "quota_source" if per_source[traj.source] >= self.config.max_queued_per_source else None
            if reason is not None:
                result.dropped[tid] = reason
                finished.append((tid, None, entry.min_version, "dropped", reason, None, traj.checksum))
                continue
            if per_prompt is not None:
                per_prompt[traj.prompt_id] += 1
            if per_source is not None:
                per_source[traj.source] += 1
            new[tid] = entry
            blobs[tid] = blob
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

    def _known_checksum(self, tid: str, seen: dict) -> str | None | bool:
        """The checksum an already-known id was offered with (None if not recorded); False if unknown."""
        if tid in seen:
            return seen[tid]
        if tid in self._queue:
            return self._queue[tid].traj.checksum
        if tid in self._done:
            return self._done[tid][2]
        return False

    # ------------------------------------------------------------------ take
    def take(self, n: int, *, min_version: int | None = None, max_version: int | None = None,
             request_id: str | None = None) -> list[Trajectory]:
        """Consume up to n trajectories whose every token's policy version is in [min_version, max_version].

        The window defaults to [version - max_version_lag, version].  With `request_id`, a
        retried call (e.g. after a coordinator or learner restart) returns the same batch.
        """
        if request_id is not None and request_id in self._takes:
            return list(self._takes[request_id])
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
            chosen, probs = self._choose(eligible, n)
            batch = [e.traj if p is None else dataclasses.replace(e.traj, sampling_probability=p)
                     for e, p in zip(chosen, probs)]
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
            self._remember_take(request_id, batch)
        return batch

    def _choose(self, eligible: list[_Entry], n: int) -> tuple[list[_Entry], list[float | None]]:
        if self.config.sampling == "fifo" or not eligible:
            return eligible[:n], [None] * min(n, len(eligible))
        weights = np.array([e.traj.priority for e in eligible], dtype=np.float64) ** self.config.priority_alpha
        p = weights / weights.sum()
        k = min(n, len(eligible))
        picks = self._rng.choice(len(eligible), size=k, replace=False, p=p)
        # sampling_probability: the chance of being drawn on one draw among the eligible set.
        return [eligible[i] for i in picks], [float(p[i]) for i in picks]

    def _remember_take(self, request_id: str, batch: list[Trajectory]) -> None:
        self._takes[request_id] = batch
        while len(self._takes) > self.config.take_replay_window:
            self._takes.popitem(last=False)

    # ------------------------------------------------------------------- TTL
    def _drop_reason(self, entry: _Entry, now: float) -> str | None:
        if self._version - entry.min_version > self.config.max_version_lag:
            return "version_lag"
        if self.config.max_age_s and now - entry.enqueued_at > self.config.max_age_s:
            return "max_age"
        return None

    def _ttl_drops(self) -> list[tuple]:
        """Remove queued trajectories past a TTL; return their `done` rows for the next commit."""
        now = self._clock()
        rows = []
        for tid, entry in list(self._queue.items()):
            reason = self._drop_reason(entry, now)
            if reason is not None:
                del self._queue[tid]
                rows.append((tid, entry.seq, entry.min_version, "dropped", reason, None, entry.traj.checksum))
        return rows

    # ------------------------------------------------------------ durability
    @contextlib.contextmanager
    def _atomic(self):
        """Undo in-memory changes if the log commit fails: nothing is acknowledged, nothing lost."""
        saved = (dict(self._queue), collections.Counter(self._counters), self._next_seq, self._version,
                 self._admission.state_dict(), self._rng.bit_generator.state)
        try:
            yield
        except BaseException:
            self._queue, self._counters, self._next_seq, self._version = saved[:4]
            self._admission.load_state_dict(saved[4])
            self._rng.bit_generator.state = saved[5]
            raise

    def _commit(self, *, enqueued=(), finished=(), take=None) -> int:
        for _, _, _, outcome, reason, _, _ in finished:
            if outcome == "dropped":
                self._counters[f"dropped/{reason}"] += 1
        if self._wal is not None:
            meta = {"version": self._version, "next_seq": self._next_seq, "counters": dict(self._counters),
                    "admission": self._admission.state_dict(), "rng": self._rng.bit_generator.state,
                    "lag_report": self._lag_report}
            self._position = self._wal.commit(enqueued=enqueued, finished=finished, take=take, meta=meta)
        else:
            self._position += 1
        for tid, _, min_version, outcome, reason, _, checksum in finished:
            self._done[tid] = (min_version, "consumed" if outcome == "consumed" else f"dropped/{reason}", checksum)
            if outcome == "dropped":
                logger.info("dropped trajectory %s: %s", tid, reason)
        return self._position

    def _maybe_compact(self, *, force: bool) -> None:
        self._since_compact += 1
        if not force and self._since_compact < self.config.compact_every:
            return
        self._since_compact = 0
        floor = self._version - self.config.max_version_lag
        # Ids of the takes kept for replay stay known, as the log keeps their rows: forgetting one here
        # let a re-send write a new `done` row over it, so a restart saw its payload as queued again.
        replayable = {t.id for batch in self._takes.values() for t in batch}
        self._done = {tid: done for tid, done in self._done.items() if done[0] >= floor or tid in replayable}
        if self._wal is not None:
            self._wal.compact(current_version=self._version, max_version_lag=self.config.max_version_lag,
                              keep_takes=self.config.take_replay_window)

    def compact(self) -> None:
        """Compact now (also happens every `compact_every` logged operations)."""
        self._maybe_compact(force=True)

    def _restore(self, state: WalState) -> None:
        self._version = int(state.meta.get("version", 0))
        self._next_seq = int(state.meta.get("next_seq", 0))
        self._counters.update(state.meta.get("counters", {}))
        self._position = state.position
        self._done = {tid: (v, "consumed" if outcome == "consumed" else f"dropped/{reason}", checksum)
                      for tid, (v, outcome, reason, checksum) in state.done.items()}
        self._admission.load_state_dict(state.meta.get("admission", {}))
        self._lag_report.update(state.meta.get("lag_report") or {})
        rng = state.meta.get("rng")
        if rng is not None and rng.get("bit_generator") == self._rng.bit_generator.state["bit_generator"]:
            try:
                self._rng.bit_generator.state = rng
            except (TypeError, ValueError, KeyError) as err:
                raise WalError(f"queue log {self.config.wal_path}: meta record 'rng' is not a "
                               f"{rng['bit_generator']} state ({err!r})") from None
        corrupt = []
        for seq, tid, enqueued_at, payload in state.queued:
            try:
                traj = Trajectory.from_bytes(payload)
                validate(traj, tokenizer_hash=self.tokenizer_hash)
                if traj.id != tid:
                    raise TrajectoryError("schema", f"row id {tid!r} holds trajectory {traj.id!r}")
            except TrajectoryError as err:
                logger.error("WAL replay: trajectory %s is unusable (%s); dropping it", tid, err)
                corrupt.append((tid, seq, -1, "dropped", f"replay_{err.reason}", None, None))
                continue
            self._queue[tid] = _Entry(traj, seq, enqueued_at, traj.oldest_version, int(traj.policy_versions.max()))
        for request_id, ids, probs in state.takes:
            try:
                batch = [Trajectory.from_bytes(state.payloads[tid]) for tid in ids]
            except (KeyError, TrajectoryError) as err:
                logger.error("WAL replay: take %r cannot be replayed (%r); a retry will take afresh", request_id, err)
                continue
            batch = [t if p is None else dataclasses.replace(t, sampling_probability=p) for t, p in zip(batch, probs)]
            self._remember_take(request_id, batch)
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
        dv_p95 = float(np.percentile(dv, 95)) if len(dv) else 0.0
        age_p95 = float(np.percentile(age, 95)) if len(age) else 0.0
        reasons = []
        if dv_p95 > self.config.backpressure_dv_p95:
            reasons.append("dv_p95")
        if age_p95 > self.config.backpressure_age_p95_s:
            reasons.append("age_p95")
        limit, taken_dv = self.config.backpressure_taken_dv_p95, self._lag_report["taken_dv_p95"]
        if limit is not None and taken_dv > limit:
            reasons.append("taken_dv_p95")
        limit, d_lag = self.config.backpressure_d_lag_p95, self._lag_report["d_lag_p95"]
        if limit is not None and d_lag is not None and not d_lag <= limit:
            reasons.append("d_lag_p95")
        return Backpressure(bool(reasons), reasons, self._starving, dv_p95, age_p95)

    def metrics(self) -> dict[str, float]:
        """Gauges and cumulative counters, keys grouped under queue/."""
        dv, age = self._lags_and_ages()
        bp = self.backpressure()
        eta = self.admission_staleness()
        out = {"queue/depth": float(len(self._queue)), "queue/version": float(self._version),
               "queue/running": float(self._admission.running), "queue/log_position": float(self._position),
               "queue/backpressure": float(bp.active), "queue/starving": float(bp.starving),
               "queue/leases_expired": float(self._admission.expired),
               "queue/backpressure_taken_dv": float("taken_dv_p95" in bp.reasons),
               "queue/backpressure_d_lag": float("d_lag_p95" in bp.reasons),
               "queue/admission_eta": float(eta),
               "queue/capacity": float(self._admission.capacity(
                   eta=eta, version=self._version,
                   accepted=self._counters["consumed"] + len(self._queue)))}
        waits = np.array(self._admission.waits, dtype=np.float64)
        for name, values in (("age_s", age), ("dv", dv), ("admission_wait_s", waits)):
            for q in (50, 95, 99):
                out[f"queue/{name}_p{q}"] = float(np.percentile(values, q)) if len(values) else 0.0
        for name in ("accepted", "consumed", "duplicates", "conflicts", "dropped/version_lag", "dropped/max_age"):
            out[f"queue/{name}"] = 0.0
        out.update({f"queue/{k}": float(v) for k, v in self._counters.items()})
        return out
