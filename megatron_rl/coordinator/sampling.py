"""Which eligible trajectories a take consumes: FIFO, or priority sampling without replacement.

    sampler = PrioritySampler(sampling="priority", priority_alpha=1.0, seed=0)
    chosen, probs = sampler.choose(eligible_entries, n=64)    # probs: None per pick under FIFO
    batch = with_sampling_probabilities([e.traj for e in chosen], probs)

Priority sampling draws k = min(n, eligible) entries without replacement with probability
proportional to Trajectory.priority ** priority_alpha; each picked trajectory carries
`sampling_probability`, its chance of being drawn on one draw among the eligible set (for
importance weighting).  The RNG state is part of the queue's durable state (`state`, saved in
the log's meta), so a restored queue draws what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from megatron_rl.coordinator.wal import WalError
from megatron_rl.trajectory import Trajectory


class PrioritySampler:
    def __init__(self, *, sampling: str, priority_alpha: float, seed: int):
        self.sampling = sampling
        self.priority_alpha = priority_alpha
        self._rng = np.random.default_rng(seed)

    @property
    def state(self) -> dict:
        """The RNG's state (JSON-able)."""
        return self._rng.bit_generator.state

    @state.setter
    def state(self, value: dict) -> None:
        self._rng.bit_generator.state = value

    def restore(self, logged: dict | None, *, wal_path: str) -> None:
        """Take the state the log's meta holds; one of another bit generator (or none) is ignored."""
        if logged is None or logged.get("bit_generator") != self.state["bit_generator"]:
            return
        try:
            self.state = logged
        except (TypeError, ValueError, KeyError) as err:
            raise WalError(f"queue log {wal_path}: meta record 'rng' is not a "
                           f"{logged['bit_generator']} state ({err!r})") from None

    def choose(self, eligible: list, n: int) -> tuple[list, list[float | None]]:
        """Up to n of the `eligible` queue entries (each with a .traj), and each pick's probability."""
        if self.sampling == "fifo" or not eligible:
            return eligible[:n], [None] * min(n, len(eligible))
        weights = np.array([e.traj.priority for e in eligible], dtype=np.float64) ** self.priority_alpha
        p = weights / weights.sum()
        picks = self._rng.choice(len(eligible), size=min(n, len(eligible)), replace=False, p=p)
        return [eligible[i] for i in picks], [float(p[i]) for i in picks]


def with_sampling_probabilities(trajs: Sequence[Trajectory], probs: Sequence[float | None]) -> list[Trajectory]:
    """The trajectories, each carrying its sampling probability where it has one."""
    return [t if p is None else dataclasses.replace(t, sampling_probability=p) for t, p in zip(trajs, probs)]
