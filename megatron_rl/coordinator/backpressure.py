"""Backpressure on staleness: the queue's signals, the learner's lag report, the eta admission uses.

    signals = BackpressureSignals(coordinator_cfg)
    bp = signals.judge(dv, age_s, starving=False)   # dv, age over the QUEUED trajectories
    eta = signals.eta(bp)                            # max_staleness, or 0 while throttled
    signals.lag_report = {"taken_dv_p95": 2.0, "d_lag_p95": 0.1}   # TrajectoryQueue.report_lag

Backpressure slows the producer through admission, before any sample is generated, instead of
letting stale samples be generated and then dropped.  It is on while any signal is past its
limit: the P95 of dv or of age over QUEUED trajectories (backpressure_dv_p95,
backpressure_age_p95_s), or what the learner reported after its last step: the P95 of dv over
the batch it took (backpressure_taken_dv_p95) and its D_lag P95 (learn/d_lag/p95,
backpressure_d_lag_p95).  With backpressure_reaction 'throttle' admission then uses eta 0
instead of max_staleness (no round admitted ahead of the learner's version), and max_staleness
again once every signal is back under its limit; 'report' only raises the signal.  Each on/off
transition is logged; metrics: queue/backpressure (0/1), queue/backpressure_taken_dv,
queue/backpressure_d_lag (which learner signal), queue/admission_eta (the eta in force).  The
queue keeps the learner's report in its log's meta, so a restored queue (or a resumed run)
admits as before.  In sync mode eta is already 0: backpressure changes nothing there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.metrics import percentile

logger = logging.getLogger(__name__)


@dataclass
class Backpressure:
    active: bool  # dv P95 or age P95 over its threshold
    reasons: list  # which thresholds are exceeded
    starving: bool  # the last take got fewer trajectories than it asked for
    dv_p95: float
    age_p95_s: float



class BackpressureSignals:
    """Judges backpressure from the queue's lags and the learner's last report; logs transitions."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.lag_report: dict = {"taken_dv_p95": 0.0, "d_lag_p95": None}  # the learner's last report_lag
        self._active = False

    @property
    def reads_lag_report(self) -> bool:
        """Whether a limit reads the learner's report (else it is not worth a log write per step)."""
        return self.config.backpressure_taken_dv_p95 is not None or self.config.backpressure_d_lag_p95 is not None

    def judge(self, dv: np.ndarray, age: np.ndarray, *, starving: bool) -> Backpressure:
        """Backpressure now, from dv and age (seconds) over the queued trajectories."""
        dv_p95, age_p95 = percentile(dv, 95), percentile(age, 95)
        reasons = []
        if dv_p95 > self.config.backpressure_dv_p95:
            reasons.append("dv_p95")
        if age_p95 > self.config.backpressure_age_p95_s:
            reasons.append("age_p95")
        limit, taken_dv = self.config.backpressure_taken_dv_p95, self.lag_report["taken_dv_p95"]
        if limit is not None and taken_dv > limit:
            reasons.append("taken_dv_p95")
        limit, d_lag = self.config.backpressure_d_lag_p95, self.lag_report["d_lag_p95"]
        if limit is not None and d_lag is not None and not d_lag <= limit:
            reasons.append("d_lag_p95")
        return Backpressure(bool(reasons), reasons, starving, dv_p95, age_p95)

    def eta(self, bp: Backpressure) -> int:
        """The eta admission uses under `bp`: max_staleness, or 0 while throttled; logs each transition once."""
        throttle = self.config.backpressure_reaction == "throttle"
        if bp.active != self._active:
            self._active = bp.active
            if bp.active:
                logger.warning("backpressure on (%s): dv_p95 %.3g, age_p95 %.3g s, taken dv_p95 %.3g, d_lag_p95 %s; %s",
                               ", ".join(bp.reasons), bp.dv_p95, bp.age_p95_s, self.lag_report["taken_dv_p95"],
                               self.lag_report["d_lag_p95"],
                               "admitting no round ahead of the learner (eta 0)" if throttle else "reporting only")
            else:
                logger.info("backpressure off: admitting up to max_staleness %d rounds ahead",
                            self.config.max_staleness)
        return 0 if throttle and bp.active else self.config.max_staleness

    @staticmethod
    def metrics(bp: Backpressure, eta: int) -> dict[str, float]:
        """queue/ gauges of backpressure and the eta in force."""
        return {"queue/backpressure": float(bp.active), "queue/starving": float(bp.starving),
                "queue/backpressure_taken_dv": float("taken_dv_p95" in bp.reasons),
                "queue/backpressure_d_lag": float("d_lag_p95" in bp.reasons), "queue/admission_eta": float(eta)}
