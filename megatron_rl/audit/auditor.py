"""The in-training audit: every `audit.every` learner steps, re-score the batch just taken's sequences that
span policy versions under their recorded versions, with the weights the learner keeps in host memory.

    auditor = Auditor(cfg.audit, policy.learner, mode=cfg.rollout.inflight_refit, rows=16, pad_id=0, multiple=2)
    outcome = auditor.check(step, taken)      # AuditOutcome: metrics (numerics/audit_*) and an AuditFailure or None

The driver calls it between take and learn (train/driver.py); the reporter logs `outcome.metrics` with the
step's and turns `outcome.failure` into the stop condition "audit" (reporting/reporter.py), so a failed audit
checkpoints and ends the run with exit 89 like any stop condition (reporting/stop.py), its message naming the
sequence and segment.  Segments of
versions the ring no longer holds (older than the take window, or from before a resume) are counted in
numerics/audit_unaudited_segments, never guessed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from megatron_rl.audit.compare import AuditReport, spans_versions
from megatron_rl.audit.config import AuditConfig
from megatron_rl.audit.rescore import audit_trajectories

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditFailure:
    """The evidence of a failed audit, as the stop condition "audit" names it (reporting/stop.py StopCondition)."""

    step: int
    metric: str
    value: float
    threshold: str
    """The bound that was crossed and where, in words."""


@dataclass
class AuditOutcome:
    """What one step's audit reports: its metrics, and the failure when a segment was over the tolerance."""

    metrics: dict[str, float] = field(default_factory=dict)
    failure: AuditFailure | None = None


class Auditor:
    """Owns the audit section; scores through the learner group's weight ring (LearnerGroup.audit_logprobs)."""

    def __init__(self, cfg: AuditConfig, learner, *, mode: str, rows: int, pad_id: int, multiple: int | None = None):
        """`rows`: at most this many sequences a call (the learner's micro-batch x data-parallel size); `multiple`:
        a call's rows are a multiple of it (the data-parallel size: a few sequences are not padded to `rows`)."""
        self.cfg, self.learner, self.mode, self.rows, self.pad_id = cfg, learner, mode, rows, pad_id
        self.multiple = multiple

    def check(self, step: int, taken: list) -> AuditOutcome:
        """Audit learner step `step`'s batch when it is due; an empty outcome otherwise."""
        if not self.cfg.due(step):
            return AuditOutcome()
        t0 = time.perf_counter()
        chosen = [t for t in taken if spans_versions(t)][:self.cfg.sequences]
        if not chosen:
            return AuditOutcome({"numerics/audit_segments": 0.0, "system/time_audit_s": time.perf_counter() - t0})
        report = audit_trajectories(chosen, self.learner.audit_logprobs, self.learner.ring_versions(),
                                    rows=self.rows, multiple=self.multiple, mode=self.mode,
                                    tolerance=self.cfg.tolerance, pad_id=self.pad_id)
        metrics = {**report.metrics(), "system/time_audit_s": time.perf_counter() - t0}  # its cost, per audited step
        return AuditOutcome(metrics, self._failure(step, report))

    def _failure(self, step: int, report: AuditReport) -> AuditFailure | None:
        for row in report.unaudited:
            logger.info("audit step %d: %s (its weights are not in the learner's ring)", step, row.describe())
        failures = report.failures
        if not failures:
            return None
        for row in failures:
            logger.error("audit step %d: %s > audit.tolerance %g", step, row.describe(), self.cfg.tolerance)
        worst = failures[0]
        more = f" (and {len(failures) - 1} more segment(s))" if len(failures) > 1 else ""
        return AuditFailure(step, "numerics/audit_worst_abs_delta", worst.max_abs_delta,
                            f"> audit.tolerance {self.cfg.tolerance:g} on {worst.describe()}{more}")
