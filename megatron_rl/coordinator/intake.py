"""What `TrajectoryQueue.put_many` tells its caller, and the queue's per-prompt / per-source quotas.

    result = queue.put_many(trajs, lease_ids=leases)     # a PutResult: every id in one bucket
    quotas = Quotas(coordinator_cfg, queued_trajectories)
    quotas.reason(traj)   # "quota_prompt" / "quota_source" / None;   quotas.add(traj) once accepted

Quotas (coordinator.max_queued_per_prompt, max_queued_per_source; 0 = no cap) count the queued
trajectories plus those accepted earlier in the same put_many call, so one call cannot overshoot.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable

from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.trajectory import Trajectory


@dataclass
class PutResult:
    """What happened to each trajectory of one put_many call (by id)."""

    accepted: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)
    conflicts: list = field(default_factory=list)  # ids already known with a different checksum
    rejected: dict = field(default_factory=dict)  # id -> "reason: message"
    dropped: dict = field(default_factory=dict)  # id -> reason
    position: int = 0  # log position after the call


class Quotas:
    """Caps on queued trajectories per prompt and per source (the attribute of Trajectory each counts)."""

    def __init__(self, config: CoordinatorConfig, queued: Iterable[Trajectory]):
        self._limits = [(reason, attr, limit) for reason, attr, limit in (
            ("quota_prompt", "prompt_id", config.max_queued_per_prompt),
            ("quota_source", "source", config.max_queued_per_source)) if limit]
        queued = list(queued) if self._limits else []
        self._counts = {attr: collections.Counter(getattr(t, attr) for t in queued) for _, attr, _ in self._limits}

    def reason(self, traj: Trajectory) -> str | None:
        """The drop reason if accepting `traj` would pass a cap, else None."""
        for reason, attr, limit in self._limits:
            if self._counts[attr][getattr(traj, attr)] >= limit:
                return reason
        return None

    def add(self, traj: Trajectory) -> None:
        for attr, counts in self._counts.items():
            counts[getattr(traj, attr)] += 1
