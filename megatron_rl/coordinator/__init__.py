"""The coordinator: owns the trajectory queue between rollout workers and the learner.

    from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue, start_coordinator

`TrajectoryQueue` (queue.py) holds all the logic and is usable without Ray;
`start_coordinator` (actor.py) runs it as a Ray actor; `WriteAheadLog` (wal.py) makes it
durable; `Admission` (admission.py) bounds staleness before rollouts start; queue.py's
docstring lists the queue's other parts.
"""

from megatron_rl.coordinator.actor import CoordinatorActor, start_coordinator
from megatron_rl.coordinator.config import CoordinatorConfig
from megatron_rl.coordinator.queue import Backpressure, PutResult, TrajectoryQueue
from megatron_rl.coordinator.wal import WalError, WriteAheadLog

__all__ = ["Backpressure", "CoordinatorActor", "CoordinatorConfig", "PutResult", "TrajectoryQueue", "WalError",
           "WriteAheadLog", "start_coordinator"]
