"""Replaying the queue's write-ahead log: the trajectories it holds as queued, the takes a retry may repeat.

    queued, corrupt = queued_trajectories(wal.load(), tokenizer_hash=h)   # [(seq, id, enqueued_at, traj)]
    for request_id, batch in replayable_takes(state): ...

A queued row whose payload is damaged (or holds another id, or breaks the trajectory contract)
is not fatal: it comes back as a `done` row dropping it with reason `replay_<reason>`, which
TrajectoryQueue commits on restore.  A take whose payloads are gone is skipped: a retry of its
request id takes afresh.
"""

from __future__ import annotations

import logging

from megatron_rl.coordinator.sampling import with_sampling_probabilities
from megatron_rl.coordinator.wal import WalState
from megatron_rl.trajectory import Trajectory, TrajectoryError, validate

logger = logging.getLogger(__name__)


def queued_trajectories(state: WalState, *, tokenizer_hash: str) -> tuple[list[tuple], list[tuple]]:
    """([(seq, id, enqueued_at, trajectory)] in seq order, `done` rows dropping the unusable ones)."""
    queued, corrupt = [], []
    for seq, tid, enqueued_at, payload in state.queued:
        try:
            traj = Trajectory.from_bytes(payload)
            validate(traj, tokenizer_hash=tokenizer_hash)
            if traj.id != tid:
                raise TrajectoryError("schema", f"row id {tid!r} holds trajectory {traj.id!r}")
        except TrajectoryError as err:
            logger.error("WAL replay: trajectory %s is unusable (%s); dropping it", tid, err)
            corrupt.append((tid, seq, -1, "dropped", f"replay_{err.reason}", None, None))
            continue
        queued.append((seq, tid, enqueued_at, traj))
    return queued, corrupt


def replayable_takes(state: WalState) -> list[tuple[str, list[Trajectory]]]:
    """[(request_id, batch)] oldest first, each batch as the take returned it."""
    takes = []
    for request_id, ids, probs in state.takes:
        try:
            batch = [Trajectory.from_bytes(state.payloads[tid]) for tid in ids]
        except (KeyError, TrajectoryError) as err:
            logger.error("WAL replay: take %r cannot be replayed (%r); a retry will take afresh", request_id, err)
            continue
        takes.append((request_id, with_sampling_probabilities(batch, probs)))
    return takes
