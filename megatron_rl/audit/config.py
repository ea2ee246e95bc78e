"""The `audit:` config section (owned by the audit, megatron_rl/audit/).

    cfg = AuditConfig(every=5, sequences=4, tolerance=1e-3)
    cfg = AuditConfig().for_run(spans_versions=True)   # every unset: DEFAULT_EVERY in a run whose tokens span versions
    cfg.ring_versions(max_version_lag=2)     # 3: versions of the weights the learner keeps in host memory

Every `every` learner steps the driver re-scores up to `sequences` trajectories of the batch it just
took whose response spans more than one policy version, under the weights of each segment's version
(the learner's host ring, audit/ring.py), and stops the run (exit 89, reporting/stop.py) when a segment
that claims KV of its own version differs from the recorded behaviour logprobs by more than
`tolerance` (audit/compare.py says which segments are judged and why).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_rl.config import ConfigError

DEFAULT_EVERY = 20
"""audit.every of a run that leaves it unset and whose sequences can span versions: measured at <= 2% of
step time on the tiny streaming recipe (benchmarks/stream_throughput.md, "The audit in ordinary runs")."""


@dataclass(kw_only=True)
class AuditConfig:
    every: int | None = None
    """Audit the batch taken every N learner steps (0 = off: no weight ring is kept).  Unset: every
    DEFAULT_EVERY steps in a run whose sequences can span versions (streaming with rollout.inflight_refit
    recompute or keep_kv on full weights), off in any other (`for_run`)."""
    sequences: int = 4
    """Multi-segment trajectories of that batch re-scored per audit (the first N that span versions)."""
    tolerance: float = 1e-3
    """Largest max |Δ logprob| a judged segment may have (nats).  The default bounds the float32 CPU path
    (vLLM's engine against the Megatron learner; measured 2.9e-6 to 3.6e-6 per segment on the tiny recipe,
    tests/e2e/test_streaming.py); serving in bf16 needs a larger one: take a few times the `initial` row of
    `megatron-rl audit` on a healthy run (RUNBOOK.md#audit-failed)."""

    def __post_init__(self) -> None:
        for name, low in (("every", 0), ("sequences", 1)):
            value = getattr(self, name)
            if value is None and name == "every":  # unset: decided by for_run
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"audit.{name} must be an int >= {low}, got {value!r}")
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol <= 0:
            raise ConfigError(f"audit.tolerance must be a finite number > 0 (nats), got {tol!r}")

    def for_run(self, *, spans_versions: bool) -> "AuditConfig":
        """This section with `every` decided: as set, else DEFAULT_EVERY when the run's sequences can span
        policy versions (an in-flight refit keeps requests generating across it), 0 when none can."""
        if self.every is not None:
            return self
        return dataclasses.replace(self, every=DEFAULT_EVERY if spans_versions else 0)

    def due(self, step: int) -> bool:
        """Whether learner step `step` (1-based: the step being taken) is audited."""
        return bool(self.every) and step % self.every == 0

    def ring_versions(self, max_version_lag: int) -> int:
        """Versions of the weights the learner keeps for the audit: every version a taken token can carry,
        the newest and the `max_version_lag` before it (the take window, coordinator/config.py); 0 when off."""
        return max_version_lag + 1 if self.every else 0
