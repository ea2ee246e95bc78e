"""CoordinatorConfig: the `coordinator:` section of the run config.

    from megatron_rl.config import from_dict
    cfg = from_dict(CoordinatorConfig, {"batch_size": 64, "max_staleness": 1, "wal_path": "run/queue.db"})
    section = run_section(data["coordinator"], mode="one_step_off")      # as a training config writes it
    cfg = for_run(cfg, mode="one_step_off", batch_size=64)                # what the run derives

A queue on its own takes every field as given.  In a training run three of them are derived, not
written (`run_section` refuses them, `for_run` sets them): batch_size is
run.prompts_per_step x run.group_size, wal_path is RUN_DIR/queue.db, and max_staleness (eta)
follows run.mode (sync 0, one_step_off 1, async ASYNC_STALENESS unless coordinator.max_staleness
overrides it, which only async mode allows).
max_version_lag (the TTL) defaults to that bound (at least 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_rl.config import ConfigError

MODE_STALENESS = {"sync": 0, "one_step_off": 1}
"""The staleness bound eta each run.mode fixes; async's is ASYNC_STALENESS or coordinator.max_staleness."""
ASYNC_STALENESS = 2

DERIVED_IN_RUN = {
    "batch_size": "it is derived: run.prompts_per_step x run.group_size",
    "wal_path": "a training run keeps its queue log in RUN_DIR/queue.db (set run.dir)",
}


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
    keep_consumed: bool = False
    """Keep every consumed trajectory's bytes in the log (table `kept`) when compacting, so `megatron-rl
    replay` can re-run the learner side exactly; costs the trajectories' size on disk (README, Replay)."""

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


def run_section(section: Any, *, mode: Any) -> Any:
    """The `coordinator:` section of a training config, its staleness bound and TTL filled in.

    Raises ConfigError for a key the run derives (naming it and what to set instead), and for
    coordinator.max_staleness outside run.mode 'async'.  A section or mode of the wrong type is
    returned as it is, for the loader to name."""
    if not isinstance(section, dict) or mode not in (*MODE_STALENESS, "async"):
        return section
    for key, why in DERIVED_IN_RUN.items():
        if key in section:
            raise ConfigError(f"coordinator.{key} cannot be set in a training config: {why}; remove it")
    if "max_staleness" in section and mode != "async":
        raise ConfigError(f"coordinator.max_staleness may only be set with run.mode 'async': run.mode {mode!r} "
                          f"fixes the staleness bound at {MODE_STALENESS[mode]}; remove it, or set run.mode=async")
    out = dict(section)
    bound = out["max_staleness"] = staleness_bound(mode, section.get("max_staleness", ASYNC_STALENESS))
    out.setdefault("max_version_lag", max(bound, 1))
    return out


def staleness_bound(mode: str, configured: Any) -> int:
    """The staleness bound eta of run.mode: sync 0, one_step_off 1, async `configured` (an int >= 1).
    The one place the mode decides it."""
    bound = MODE_STALENESS.get(mode, configured)
    if mode == "async" and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
        raise ConfigError(f"coordinator.max_staleness must be an int >= 1 in run.mode 'async' (0 is run.mode "
                          f"'sync'), got {bound!r}")
    return bound


def for_run(config: CoordinatorConfig, *, mode: str, batch_size: int) -> CoordinatorConfig:
    """The coordinator a training run uses: B is its batch, and the staleness bound the one its mode
    fixes (async keeps its own, >= 1); the TTL must not drop what admission let in."""
    bound = staleness_bound(mode, config.max_staleness)
    config = dataclasses.replace(config, batch_size=batch_size, max_staleness=bound)
    if config.max_version_lag < bound:
        raise ConfigError(f"coordinator.max_version_lag ({config.max_version_lag}) is below the staleness bound "
                          f"({bound}, run.mode {mode!r}): admitted samples would expire")
    return config


def plan_entry(config: CoordinatorConfig) -> dict:
    """What `train --dry-run` shows of the coordinator: B, the staleness bound and the TTL."""
    return {"batch_size": config.batch_size, "max_staleness": config.max_staleness,
            "max_version_lag": config.max_version_lag}
