"""Rollout rounds, produced as far ahead as the coordinator admits.

    producer = Producer(coordinator, sample_round, steps=100)   # sample_round(r) -> (samples, stats)
    producer.start(state)                                 # state.rounds: rounds saved by a checkpoint
    rnd = producer.next(step)     # Round: samples, leases, seconds, stats; one round = one learner batch
    rounds = producer.pause(); ...; producer.unpause()    # a checkpoint: finished rounds, none in flight
    producer.stop()   # the coordinator's version, set on publish, opens admission

One background thread runs rounds in order: ask the coordinator for B admissions (the
admission rule (eta + v + 1) x B - (accepted + running) > 0 bounds staleness before any
compute is spent), sample the round (`sample_round`, the rollout source: prompts from the data
cursor, generated on the rollout fleet), and hand the samples to the driver.  The run mode only
sets how far ahead it may go (the coordinator's bound eta, `Coordinator.lookahead`):

  sync          eta 0: round s starts after version s is published (on-policy)
  one_step_off  eta 1: round s+1 may sample with version s while step s learns,
                so every sample is at most one version stale (Δv <= 1)
  async         eta k: up to k versions ahead

so the same code serves every mode and the coordinator remains the single place that
decides.  Rounds are numbered like steps; per-request sampling seeds derive from the run seed
and the round.

Exact resume.  A checkpoint `pause`s the producer: no new round starts, the round in flight
finishes, and the finished rounds the learner has not consumed yet (samples with their tokens,
logprobs and per-token versions, plus their admission leases) are saved in the checkpoint with
the data cursor as it is then (just after the last saved round drew its prompts).  A resumed
run replays those rounds before generating new ones, so every round carries the version it had
in the uninterrupted run; the leases are live again because the coordinator's admission state is
in the queue snapshot of the same checkpoint.  While a round is generated or waits for the
learner, a keep-alive thread renews its leases every lease_ttl_s / 3, so only a dead producer's
leases expire (an expired lease's trajectories are dropped, see coordinator/admission.py).
For the same reason the producer runs `lookahead` rounds past run.steps: a run of 2 steps then
checkpoints the round that a 4-step run sampled with version 1 during step 1, so raising
run.steps and resuming continues exactly (a run that ends for good discards those rounds).  In async mode the version a round
gets depends on timing in any run; what is exact there is that resume loses nothing in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from megatron_rl.coordinator.client import Coordinator
from megatron_rl.sampling.producer_parts import Leases, ProducerThread

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Round:
    index: int
    samples: list
    leases: list
    seconds: float
    stats: dict = dataclasses.field(default_factory=dict)
    """Dynamic sampling's account of the round (sampling/dynamic_sampling.py); empty when it is off."""

    def to_dict(self) -> dict:
        return {"index": self.index, "samples": [s.to_dict() for s in self.samples], "leases": list(self.leases),
                "seconds": self.seconds, "stats": dict(self.stats)}

    @classmethod
    def from_dict(cls, data: dict) -> "Round":
        from megatron_rl.rollout.sample import RolloutSample

        return cls(int(data["index"]), [RolloutSample.from_dict(s) for s in data["samples"]], list(data["leases"]),
                   float(data["seconds"]), dict(data.get("stats", {})))


@dataclasses.dataclass
class TrainState:
    step: int
    version: int
    rounds: list = dataclasses.field(default_factory=list)  # Rounds saved by the checkpoint, replayed first
    in_flight: list = dataclasses.field(default_factory=list)
    """Streaming: the prompt groups generating when the checkpoint was written, generated again first
    (stream_producer.py: serial, examples' indices, leases)."""
    serials: dict = dataclasses.field(default_factory=dict)
    """Streaming: the next serial and the groups that produced no batch, at the checkpoint (stream_producer.py)."""


class Producer:
    """Runs rollout rounds in order on a background thread, each admitted by the coordinator first."""

    def __init__(self, coordinator: Coordinator, sample_round: Callable[[int], tuple[list, dict]], *, steps: int):
        self.coordinator = coordinator
        self.sample_round = sample_round
        self.steps = steps
        self.loop = ProducerThread("rollout-producer")
        self.leases = Leases(coordinator, quit=self.loop.quit_asked)
        self._ready: dict[int, Round] = {}  # finished rounds the driver has not taken yet

    def start(self, state: TrainState) -> None:
        first = state.step
        for rnd in state.rounds:  # generated before the checkpoint: replayed as they were
            self._ready[rnd.index] = rnd
            first = max(first, rnd.index + 1)
        if state.rounds:
            logger.info("replaying rollout rounds %s saved by the checkpoint", sorted(self._ready))
        self.loop.start(self._run, first)
        for rnd in state.rounds:
            self.leases.hold(rnd.leases)
        self.leases.keep_alive(self.loop.stopping)

    def _run(self, first_round: int) -> None:
        loop = self.loop
        need = self.coordinator.config.batch_size  # one round = one learner batch
        r = first_round
        last = self.steps + self.coordinator.lookahead  # rounds a longer run would sample before step `steps`
        try:
            while r < last:
                with loop.cond:
                    while loop.paused and not loop.stopping.is_set():
                        loop.cond.wait(0.1)
                    if loop.stopping.is_set():
                        return
                    loop.busy = True
                try:
                    leases = self.leases.admit(need, r)
                    if leases is None:
                        continue
                    t0 = time.perf_counter()
                    samples, stats = self.sample_round(r)
                    with loop.cond:
                        self._ready[r] = Round(r, samples, leases, time.perf_counter() - t0, stats)
                    r += 1
                finally:
                    loop.idle()
        except BaseException as err:  # surfaced to the driver on its next call
            loop.fail(err)

    def next(self, step: int) -> Round:
        """Round `step` (samples, admission leases, seconds, dynamic sampling's account), waiting for it."""
        loop = self.loop
        with loop.cond:
            while step not in self._ready:
                loop.raise_if_failed()
                if not loop.alive():
                    raise RuntimeError("rollout producer stopped without producing round %d" % step)
                loop.cond.wait(1.0)
            item = self._ready.pop(step)
        self.leases.hand_out(item.leases)
        return item

    def pause(self) -> list[Round]:
        """Start no new round, let the one in flight finish; the finished rounds not yet taken."""
        self.loop.pause(self.coordinator.wake_admission, busy=lambda: self.loop.busy and self.loop.alive())
        with self.loop.cond:
            return [self._ready[k] for k in sorted(self._ready)]

    def in_flight(self) -> list[dict]:
        """Nothing: a pause lets the round in flight finish (rounds are whole generate calls)."""
        return []

    def serials(self) -> dict[str, int]:
        """Nothing: a round's number is its step."""
        return {}

    def unpause(self) -> None:
        self.loop.unpause()

    def stop(self) -> None:
        self.loop.stop(self.coordinator.wake_admission, self.leases.keepalive)
