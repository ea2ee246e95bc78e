"""Admission control: bound staleness before any rollout compute is spent.

    adm = Admission(batch_size=64, lease_ttl_s=600, clock=time.time)
    leases = adm.admit(n=8, eta=1, version=3, accepted=200, worker="rollout-0", request_id="round-4/0")
    adm.is_live(leases[0]); adm.complete(leases[0]); adm.release(leases[1:])
    state = adm.state_dict(); Admission(...).load_state_dict(state)   # survives a restart

The rule (AReaL, "asynchronous RL with bounded staleness", sec. 5.1): a new rollout may start
only while

    (eta + v + 1) * B - (accepted + running) > 0

with v the learner's policy version, B the learner's batch size, `accepted` the trajectories
accepted so far that were not dropped (consumed + queued) and `running` the outstanding
leases.  Each granted slot is a lease id; it ends by `complete` (its trajectory arrived),
`release` (the rollout was abandoned) or expiry after `lease_ttl_s`, so a crashed rollout
worker cannot hold slots forever.

Invariant: accepted + running <= (eta + v + 1) * B at every version v, for every trajectory
that arrives on a lease.  Two events could break it, and both are closed here:

* Restart.  The lease table is part of the coordinator's durable state: the queue writes
  `state_dict()` into its WAL with every commit that changes it (grant, completion, expiry),
  and a restarted coordinator loads it, so `running` does not fall to 0 and no extra round is
  admitted.  On load every lease's clock restarts: a restart can lengthen a lease by at most one
  TTL, never free a slot early.  `admit` with a `request_id` is idempotent (a retried call after
  a crash returns the leases the first call granted instead of granting new ones).
* Expiry.  Expiry is for rollouts that died: a live holder keeps its leases by `renew`ing them
  (the trainer's producer renews every lease_ttl_s / 3 while a round is generated or waits to be
  learned from), so a long round does not lose its slots.  An expired lease frees its slot at
  once and is revoked:
  a trajectory that later arrives on it is not accepted (the queue drops it as
  `lease_expired` and counts it), because its slot may already have been granted to another
  rollout and accepting it too would push accepted + running past the bound.  The lost work is
  the price of bounded staleness; raise `lease_ttl_s` above the longest round to avoid it.

Trajectories put WITHOUT a lease are not admission-controlled (tests, tools); the driver always
passes the leases of its rounds.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Iterable

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, *, batch_size: int, lease_ttl_s: float, clock: Callable[[], float]):
        self.batch_size = batch_size
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, tuple[float, str | None]] = {}  # lease id -> (granted at, request id)
        self._next_id = 0
        self._refused_since: dict[str, float] = {}  # worker -> first refusal of its current wait
        self.waits: collections.deque[float] = collections.deque(maxlen=1024)  # seconds, per grant
        self.expired = 0

    @property
    def running(self) -> int:
        return len(self._leases)

    def capacity(self, *, eta: int, version: int, accepted: int) -> int:
        return (eta + version + 1) * self.batch_size - (accepted + self.running)

    def is_live(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def expire(self) -> int:
        now = self._clock()
        stale = [lid for lid, (t, _) in self._leases.items() if now - t > self.lease_ttl_s]
        for lid in stale:
            del self._leases[lid]
        if stale:
            self.expired += len(stale)
            logger.warning("%d rollout leases expired after %.0f s without a trajectory; a trajectory arriving "
                           "on one of them will be dropped", len(stale), self.lease_ttl_s)
        return len(stale)

    def admit(self, n: int, *, eta: int, version: int, accepted: int, worker: str = "",
              request_id: str | None = None) -> list[str]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"try_admit: n must be an int >= 0, got {n!r}")
        if request_id is not None:
            earlier = [lid for lid, (_, rid) in self._leases.items() if rid == request_id]
            if earlier:  # a retried call: the same grant, not a second one
                return earlier
        granted = max(0, min(n, self.capacity(eta=eta, version=version, accepted=accepted)))
        now = self._clock()
        if granted == 0:
            if n > 0:
                self._refused_since.setdefault(worker, now)
            return []
        self.waits.append(now - self._refused_since.pop(worker, now))
        leases = []
        for _ in range(granted):
            lid = f"v{version}-{self._next_id}"
            self._next_id += 1
            self._leases[lid] = (now, request_id)
            leases.append(lid)
        return leases

    def renew(self, lease_ids: Iterable[str]) -> int:
        """Restart the clocks of these leases (a live holder's heartbeat); returns how many were still live."""
        now = self._clock()
        live = 0
        for lid in lease_ids:
            if lid in self._leases:
                self._leases[lid] = (now, self._leases[lid][1])
                live += 1
        return live

    def complete(self, lease_id: str | None) -> None:
        if lease_id is not None and self._leases.pop(lease_id, None) is None:
            logger.debug("lease %s unknown (expired, released or never granted)", lease_id)

    def release(self, lease_ids: Iterable[str]) -> None:
        for lid in lease_ids:
            self.complete(lid)

    # ---- durability (the queue stores this in its WAL) ---------------------------------------------

    def state_dict(self) -> dict:
        return {"leases": {lid: rid for lid, (_, rid) in self._leases.items()}, "next_id": self._next_id,
                "expired": self.expired}

    def load_state_dict(self, state: dict) -> None:
        now = self._clock()  # clocks restart: never expire a lease for time spent while we were down
        self._leases = {lid: (now, rid) for lid, rid in state.get("leases", {}).items()}
        self._next_id = max(self._next_id, int(state.get("next_id", 0)))
        self.expired = int(state.get("expired", 0))


