"""TTL eviction of queued trajectories: the version window and the age limit.

    entry = QueuedEntry(traj, seq=7, enqueued_at=now, min_version=3, max_version=4)
    drop_reason(entry, version=6, now=now, config=coordinator_cfg)   # "version_lag", "max_age" or None
    rows = evict(queue, version=6, now=now, config=coordinator_cfg)  # removed; their `done` rows

A queued trajectory is dropped once its OLDEST per-token policy version lags the learner's by
more than coordinator.max_version_lag ("version_lag"), or once it has waited longer than
coordinator.max_age_s ("max_age", 0 = no limit).  The same rule judges a trajectory on arrival,
so one that is already too stale is dropped instead of queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.trajectory import Trajectory


@dataclass
class QueuedEntry:
    traj: Trajectory
    seq: int  # arrival order, the log's row key
    enqueued_at: float  # clock seconds
    min_version: int  # oldest per-token policy version
    max_version: int  # newest per-token policy version


def drop_reason(entry: QueuedEntry, *, version: int, now: float, config: CoordinatorConfig) -> str | None:
    if version - entry.min_version > config.max_version_lag:
        return "version_lag"
    if config.max_age_s and now - entry.enqueued_at > config.max_age_s:
        return "max_age"
    return None


def evict(queue: dict[str, QueuedEntry], *, version: int, now: float, config: CoordinatorConfig) -> list[tuple]:
    """Remove the entries of `queue` (id -> entry) past a TTL; return their `done` rows for the next commit."""
    rows = []
    for tid, entry in list(queue.items()):
        reason = drop_reason(entry, version=version, now=now, config=config)
        if reason is not None:
            del queue[tid]
            rows.append((tid, entry.seq, entry.min_version, "dropped", reason, None, entry.traj.checksum))
    return rows
