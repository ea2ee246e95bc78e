"""CoordinatorConfig: the `coordinator:` section of the run config.

    from megatron_rl.config import from_dict
    cfg = from_dict(CoordinatorConfig, {"batch_size": 64, "max_staleness": 1, "wal_path": "run/queue.db"})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(kw_only=True)
class CoordinatorConfig:
    batch_size: int = 64
    """Trajectories the learner consumes per version step (B in the admission rule)."""
    max_staleness: int = 1
    """eta: admission keeps (accepted + running) <= (eta + v + 1) * B, bounding staleness before compute is spent."""
    max_version_lag: int = 1
    """TTL: drop a trajectory when learner version - its oldest token's policy version exceeds this."""
    max_age_s: float = 3600.0
    """TTL: drop a trajectory queued longer than this many seconds (0 disables)."""
    lease_ttl_s: float = 1800.0
    """An admitted rollout that neither completes nor is released within this many seconds frees its slot."""
    max_queued_per_prompt: int = 0
    """At most this many queued trajectories per prompt_id; extra ones are dropped as 'quota_prompt' (0 = no limit)."""
    max_queued_per_source: int = 0
    """At most this many queued trajectories per source; extra ones are dropped as 'quota_source' (0 = no limit)."""
    sampling: Literal["fifo", "priority"] = "fifo"
    """How take() picks among eligible trajectories: oldest first, or proportional to priority**alpha."""
    priority_alpha: float = 1.0
    """Exponent on Trajectory.priority in priority sampling (0 = uniform)."""
    seed: int = 0
    """Seed of the priority sampler's random generator."""
    backpressure_dv_p95: float = 1.0
    """Backpressure when the P95 of version lag over queued trajectories exceeds this many versions."""
    backpressure_age_p95_s: float = 600.0
    """Backpressure when the P95 of queue age exceeds this many seconds."""
    backpressure_taken_dv_p95: Optional[float] = None
    """Backpressure when the P95 of version lag (dv) over the learner's last batch exceeds this (None = off)."""
    backpressure_d_lag_p95: Optional[float] = None
    """Backpressure when the learner's last D_lag P95 (learn/d_lag/p95) exceeds this (None = off)."""
    backpressure_reaction: Literal["throttle", "report"] = "throttle"
    """Under backpressure: 'throttle' admits as if max_staleness were 0; 'report' only raises the signal."""
    wal_path: str = ""
    """SQLite write-ahead log file; empty keeps the queue in memory only (no durability)."""
    wal_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    """SQLite synchronous: FULL fsyncs each commit (survives power loss); NORMAL only a process kill (faster).

    FULL is the default because a consumption rolled back by a power loss could be taken twice."""
    compact_every: int = 256
    """Compact the log after this many logged batch operations."""
    take_replay_window: int = 8
    """How many recent take request ids keep their batch, so a retried take gets the same trajectories."""

    def __post_init__(self):
        for name in ("batch_size", "compact_every", "take_replay_window"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"coordinator.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("max_staleness", "max_version_lag", "max_queued_per_prompt", "max_queued_per_source", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"coordinator.{name} must be an int >= 0, got {getattr(self, name)!r}")
        for name in ("max_age_s", "priority_alpha", "backpressure_dv_p95", "backpressure_age_p95_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"coordinator.{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("backpressure_taken_dv_p95", "backpressure_d_lag_p95"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"coordinator.{name} must be a number >= 0 or null (off), got {value!r}")
        if not isinstance(self.lease_ttl_s, (int, float)) or self.lease_ttl_s <= 0:
            raise ValueError(f"coordinator.lease_ttl_s must be > 0, got {self.lease_ttl_s!r}")
        choices = {"sampling": ("fifo", "priority"), "backpressure_reaction": ("throttle", "report"),
                   "wal_synchronous": ("FULL", "NORMAL")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"coordinator.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not isinstance(self.wal_path, str):
            raise ValueError(f"coordinator.wal_path must be a str, got {self.wal_path!r}")
