"""Admission control: bound staleness before any rollout compute is spent.

    adm = Admission(batch_size=64, lease_ttl_s=600, clock=time.time)
    leases = adm.admit(n=8, eta=1, version=3, accepted=200, worker="rollout-0")
    adm.complete(leases[0]); adm.release(leases[1:])

The rule (AReaL, "asynchronous RL with bounded staleness", sec. 5.1): a new rollout may start
only while

    (eta + v + 1) * B - (accepted + running) > 0

with v the learner's policy version, B the learner's batch size, `accepted` the trajectories
accepted so far that were not dropped (consumed + queued) and `running` the outstanding
leases.  Each granted slot is a lease id; it ends by `complete` (its trajectory arrived),
`release` (the rollout was abandoned) or expiry after `lease_ttl_s`, so a crashed rollout
worker cannot hold slots forever.  Leases live in memory only: after a coordinator restart
`running` starts at 0 and completing an unknown lease is a no-op.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Callable, Iterable

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, *, batch_size: int, lease_ttl_s: float, clock: Callable[[], float]):
        self.batch_size = batch_size
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, float] = {}  # lease id -> granted at
        self._ids = itertools.count()
        self._refused_since: dict[str, float] = {}  # worker -> first refusal of its current wait
        self.waits: collections.deque[float] = collections.deque(maxlen=1024)  # seconds, per grant
        self.expired = 0

    @property
    def running(self) -> int:
        return len(self._leases)

    def capacity(self, *, eta: int, version: int, accepted: int) -> int:
        return (eta + version + 1) * self.batch_size - (accepted + self.running)

    def expire(self) -> int:
        now = self._clock()
        stale = [lid for lid, t in self._leases.items() if now - t > self.lease_ttl_s]
        for lid in stale:
            del self._leases[lid]
        if stale:
            self.expired += len(stale)
            logger.warning("%d rollout leases expired after %.0f s without a trajectory", len(stale), self.lease_ttl_s)
        return len(stale)

    def admit(self, n: int, *, eta: int, version: int, accepted: int, worker: str = "") -> list[str]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"try_admit: n must be an int >= 0, got {n!r}")
        self.expire()
        granted = max(0, min(n, self.capacity(eta=eta, version=version, accepted=accepted)))
        now = self._clock()
        if granted == 0:
            if n > 0:
                self._refused_since.setdefault(worker, now)
            return []
        self.waits.append(now - self._refused_since.pop(worker, now))
        leases = [f"v{version}-{next(self._ids)}" for _ in range(granted)]
        for lid in leases:
            self._leases[lid] = now
        return leases

    def complete(self, lease_id: str | None) -> None:
        if lease_id is not None and self._leases.pop(lease_id, None) is None:
            logger.debug("lease %s unknown (expired, or granted before a restart)", lease_id)

    def release(self, lease_ids: Iterable[str]) -> None:
        for lid in lease_ids:
            self.complete(lid)
