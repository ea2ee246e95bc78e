"""The coordinator as a Ray actor: a thin wrapper around TrajectoryQueue.

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

import os
from typing import Any

from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.coordinator.queue import TrajectoryQueue
from megatron_rl.drill.hooks import maybe_stop_coordinator


class CoordinatorActor:
    """Every public method forwards to TrajectoryQueue (see queue.py for semantics)."""

    def __init__(self, config: CoordinatorConfig, tokenizer_hash: str):
        from megatron_rl.console import configure_worker_logging

        configure_worker_logging()  # its warnings (e.g. backpressure) reach the driver's console
        self._queue = TrajectoryQueue(config, tokenizer_hash=tokenizer_hash)

    def pid(self) -> int:
        return os.getpid()

    def try_admit(self, n: int, worker: str = "", request_id: str | None = None) -> list[str]:
        return self._queue.try_admit(n, worker=worker, request_id=request_id)

    def renew(self, lease_ids: list[str]) -> int:
        return self._queue.renew(lease_ids)

    def admission_bound(self) -> tuple[int, int]:
        return self._queue.admission_bound()

    def release(self, lease_ids: list[str]) -> None:
        self._queue.release(lease_ids)

    def put_many(self, trajs: list, lease_ids: list | None = None):
        maybe_stop_coordinator(trajs)  # drill hook (coordinator_stop); no-op without MEGATRON_RL_DRILL
        return self._queue.put_many(trajs, lease_ids)

    def take(self, n: int, min_version: int | None = None, max_version: int | None = None,
             request_id: str | None = None) -> list:
        return self._queue.take(n, min_version=min_version, max_version=max_version, request_id=request_id)

    def set_version(self, version: int) -> None:
        self._queue.set_version(version)

    def queued_ids(self) -> list[str]:
        return self._queue.queued_ids()

    def position(self) -> int:
        return self._queue.position

    def metrics(self) -> dict[str, float]:
        return self._queue.metrics()

    def report_lag(self, dv_p95: float, d_lag_p95: float | None = None) -> None:
        self._queue.report_lag(dv_p95=dv_p95, d_lag_p95=d_lag_p95)

    def backpressure(self):
        return self._queue.backpressure()

    def compact(self) -> None:
        self._queue.compact()


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
