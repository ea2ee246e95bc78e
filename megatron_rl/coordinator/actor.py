"""The coordinator as a Ray actor: TrajectoryQueue's API (VERBS, declared once below), served one call at a time.

    import ray
    from megatron_rl.coordinator import CoordinatorConfig, start_coordinator
    ray.init(num_cpus=2, include_dashboard=False)
    coord = start_coordinator(CoordinatorConfig(wal_path="run/queue.db"), tokenizer_hash=h)
    leases = ray.get(coord.try_admit.remote(8, worker="rollout-0"))
    ray.get(coord.put_many.remote(trajs, leases))
    batch = ray.get(coord.take.remote(64, request_id="step-12"))

The actor runs one call at a time (max_concurrency=1), so the queue needs no locks.  With a
WAL it is started with `max_restarts=-1, max_task_retries=-1`: if its process dies, Ray
restarts it, the new instance replays the log, and in-flight calls are retried.  That is
safe because put_many is idempotent by trajectory id (and content checksum), try_admit and
take are idempotent by request_id, and admission leases are in the log; a take WITHOUT
request_id that dies mid-call may lose its batch to the dead process, so consumers should
always pass one (the learner uses its step number).  Pin the actor to the node that holds
`wal_path` (pass `scheduling_strategy` or `resources`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.coordinator.queue import TrajectoryQueue
from megatron_rl.fault_hooks import maybe_stop_coordinator

VERBS = ("try_admit", "renew", "release", "admission_bound", "put_many", "take", "set_version", "queued_ids",
         "metrics", "report_lag", "backpressure", "compact")
"""The coordinator's API, declared once: TrajectoryQueue's methods of these names (queue.py: semantics,
signatures, types) are the actor's, forwarded as they are (`_forwarder`); the driver's Coordinator
(client.py) calls them by name (`remote_verb` for the ones it passes through).  A new verb: a queue
method and its name here."""

_BEFORE = {"put_many": lambda trajs, *a, **k: maybe_stop_coordinator(trajs)}
"""Drill hooks run in the actor before a verb (coordinator_stop; no-op without MEGATRON_RL_DRILL)."""


def _forwarder(name: str):
    """The actor's method `name`: TrajectoryQueue.`name` on the actor's queue (its signature and docstring)."""
    method, before = getattr(TrajectoryQueue, name), _BEFORE.get(name)

    @functools.wraps(method)
    def forward(self, *args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        return method(self._queue, *args, **kwargs)

    return forward


def remote_verb(name: str):
    """A client method (client.py) that calls verb `name` on the actor and waits for its answer."""
    if name not in VERBS:
        raise ValueError(f"{name!r} is not a coordinator verb (coordinator/actor.py VERBS)")

    @functools.wraps(getattr(TrajectoryQueue, name))
    def call(self, *args, **kwargs):
        return self._get(getattr(self.actor, name).remote(*args, **kwargs))

    return call


class CoordinatorActor:
    """The queue's VERBS, forwarded (generated below), plus what only the actor answers."""

    def __init__(self, config: CoordinatorConfig, tokenizer_hash: str):
        from megatron_rl.console import configure_worker_logging

        configure_worker_logging()  # its warnings (e.g. backpressure) reach the driver's console
        self._queue = TrajectoryQueue(config, tokenizer_hash=tokenizer_hash)

    def pid(self) -> int:
        return os.getpid()

    def position(self) -> int:
        """The queue's log position (a property of the queue, a call on the actor)."""
        return self._queue.position


for _verb in VERBS:
    setattr(CoordinatorActor, _verb, _forwarder(_verb))


def start_coordinator(config: CoordinatorConfig, *, tokenizer_hash: str, name: str | None = None,
                      **ray_options: Any):
    """Create the coordinator actor (Ray must be initialised); returns its handle."""
    import ray

    options = {"num_cpus": 0, "max_concurrency": 1}
    if config.wal_path:
        options.update(max_restarts=-1, max_task_retries=-1)
    if name is not None:
        options["name"] = name
    options.update(ray_options)
    return ray.remote(CoordinatorActor).options(**options).remote(config, tokenizer_hash)
