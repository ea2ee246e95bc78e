"""The driver's handle on the coordinator actor, and the staleness policy of a training run.

    coord = Coordinator.start(cfg.coordinator, wal_path=run_dir / "queue.db", tokenizer_hash=h, take_timeout_s=600)
    leases = coord.try_admit(8, request_id="round-3/0")    # admission: (eta + v + 1) x B bounds staleness
    coord.put(trajs, leases)                                # idempotent by trajectory id
    batch = coord.take_for_step(step, version)              # one batch inside [v - max_staleness, v]
    coord.set_version(version + 1)                          # after a publication: admission opens

The whole staleness policy lives in this package: admission (admission.py, queue.py), the TTL
(queue.py) and the take window below all read `CoordinatorConfig.max_staleness`; callers only see
`lookahead`, how many rounds a producer may run ahead of the learner.  Every method is one Ray call
on the actor (actor.py), which runs them one at a time; the verbs are declared once (actor.py `VERBS`),
and the ones this client passes through as they are come from there (`remote_verb`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.coordinator.actor import remote_verb, start_coordinator
from megatron_rl.coordinator.config import CoordinatorConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


class Coordinator:
    """The coordinator actor as a typed object; `config` is the section it was started with."""

    def __init__(self, actor: ActorHandle, config: CoordinatorConfig, *, take_timeout_s: float = 600.0):
        self.actor = actor
        self.config = config
        self.take_timeout_s = take_timeout_s
        self._opened = threading.Condition()
        self.admission_epoch = 0
        """Counts this client's calls that may open admission (set_version, release, report_lag)."""
        self.published: int | None = None
        """The last version this client's set_version announced (None before the first): every rollout group
        that answered holds it from then on, since the driver announces a version only once it is published."""

    @classmethod
    def start(cls, config: CoordinatorConfig, *, wal_path: str | Path, tokenizer_hash: str,
              take_timeout_s: float = 600.0) -> "Coordinator":
        """Start the actor on `config` with its write-ahead log at `wal_path` (Ray must be up)."""
        import dataclasses

        config = dataclasses.replace(config, wal_path=str(wal_path))
        return cls(start_coordinator(config, tokenizer_hash=tokenizer_hash), config, take_timeout_s=take_timeout_s)

    @property
    def lookahead(self) -> int:
        """Rounds a producer may sample ahead of the learner's version (the staleness bound)."""
        return self.config.max_staleness

    def _get(self, ref):
        import ray

        return ray.get(ref)

    # ---- admission (the producer) ------------------------------------------------------------------

    def try_admit(self, n: int, *, worker: str = "producer", request_id: str | None = None) -> list[str]:
        return self._get(self.actor.try_admit.remote(n, worker=worker, request_id=request_id))

    def wait_admission(self, epoch: int, timeout: float) -> None:
        """Wait (at most `timeout` s) until a call of this client may have opened admission since
        `admission_epoch` was `epoch`: a producer refused admission waits here instead of polling."""
        with self._opened:
            self._opened.wait_for(lambda: self.admission_epoch != epoch, timeout)

    def wake_admission(self) -> None:
        """Wake producers waiting in wait_admission (a pause or stop, or admission may have opened)."""
        with self._opened:
            self.admission_epoch += 1
            self._opened.notify_all()

    renew = remote_verb("renew")

    def release(self, leases: list[str]) -> None:
        self._get(self.actor.release.remote(leases))
        self.wake_admission()

    # ---- the queue ---------------------------------------------------------------------------------

    def put(self, trajs: list, leases: list[str] | None = None) -> dict:
        """Enqueue scored trajectories under their admission leases; returns the counts."""
        result = self._get(self.actor.put_many.remote(trajs, leases))
        if result.rejected:
            logger.warning("coordinator rejected %d trajectories, e.g. %s", len(result.rejected),
                           next(iter(result.rejected.values())))
        if result.conflicts:
            logger.error("coordinator refused %d trajectories whose ids it already holds with other content, e.g. %s",
                         len(result.conflicts), result.conflicts[0])
        return {"accepted": len(result.accepted), "rejected": len(result.rejected), "dropped": len(result.dropped),
                "conflicts": len(result.conflicts)}

    def take_for_step(self, step: int, version: int) -> list:
        """The batch (B = config.batch_size trajectories) learner step `step` trains on at policy
        `version`: every trajectory inside the window [version - max_staleness, version].  Waits up
        to take_timeout_s for it; a short batch means the queue dropped some (TTL, quota) and is an
        error rather than a partial step."""
        window_lo = version - self.config.max_staleness
        need = self.config.batch_size
        deadline = time.monotonic() + self.take_timeout_s
        while True:
            batch = self._get(self.actor.take.remote(need, min_version=window_lo, max_version=version,
                                                     request_id=f"step-{step}"))
            if len(batch) == need:
                return batch
            if batch:
                raise RuntimeError(f"step {step}: the coordinator returned {len(batch)} of {need} trajectories "
                                   f"in versions [{window_lo}, {version}]; see queue/dropped_* metrics")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: no trajectories within versions [{window_lo}, {version}] "
                                   f"after {self.take_timeout_s} s")
            time.sleep(0.05)

    # ---- the learner's side --------------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The learner published `version`: admission and the TTL move with it."""
        self._get(self.actor.set_version.remote(version))
        self.published = version
        self.wake_admission()

    def report_lag(self, dv: list[float], d_lag_p95: float | None) -> None:
        """The lag the learner's last batch showed (version lags dv, D_lag P95); past the
        coordinator.backpressure_* limits admission slows down (queue.py)."""
        from megatron_rl.metrics import percentiles

        dv_p95 = percentiles(dv or [0.0], "dv", qs=(95,))["dv/p95"]
        self._get(self.actor.report_lag.remote(dv_p95=float(dv_p95),
                                               d_lag_p95=None if d_lag_p95 is None else float(d_lag_p95)))
        self.wake_admission()

    metrics = remote_verb("metrics")

    def position(self) -> int:
        """The log position a checkpoint records."""
        return self._get(self.actor.position.remote())
