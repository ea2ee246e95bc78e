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
import threading
import time
from typing import Callable

from megatron_rl.coordinator.client import Coordinator

logger = logging.getLogger(__name__)

ADMIT_RETRY_S = 0.25  # a refused producer asks again this often at least (leases expire, other processes)


@dataclasses.dataclass
class Round:
    index: int
    samples: list
    leases: list
    seconds: float
    stats: dict = dataclasses.field(default_factory=dict)
    """Dynamic sampling's account of the round (train/dynamic_sampling.py); empty when it is off."""

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


class Producer:
    """Runs rollout rounds in order on a background thread, each admitted by the coordinator first."""

    def __init__(self, coordinator: Coordinator, sample_round: Callable[[int], tuple[list, dict]], *, steps: int):
        self.coordinator = coordinator
        self.sample_round = sample_round
        self.steps = steps
        self._cond = threading.Condition()
        self._ready: dict[int, Round] = {}  # finished rounds the driver has not taken yet
        self._paused = False
        self._busy = False  # a round is between admission and being ready
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._held: set[str] = set()  # leases of rounds admitted and not yet handed to the driver
        self._handed: list[str] = []  # leases of the round last handed out (enqueued soon)
        self._keepalive: threading.Thread | None = None

    def start(self, state: TrainState) -> None:
        first = state.step
        for rnd in state.rounds:  # generated before the checkpoint: replayed as they were
            self._ready[rnd.index] = rnd
            first = max(first, rnd.index + 1)
        if state.rounds:
            logger.info("replaying rollout rounds %s saved by the checkpoint", sorted(self._ready))
        self._thread = threading.Thread(target=self._run, args=(first,), name="rollout-producer", daemon=True)
        self._thread.start()
        for rnd in state.rounds:
            self._held.update(rnd.leases)
        self._keepalive = threading.Thread(target=self._renew_leases, name="lease-keepalive", daemon=True)
        self._keepalive.start()

    def _renew_leases(self) -> None:
        while not self._stop.wait(self.coordinator.config.lease_ttl_s / 3):
            with self._cond:
                leases = sorted(self._held.union(self._handed))
            if leases:
                try:
                    self.coordinator.renew(leases)
                except Exception as err:  # the next beat retries; expiry is the coordinator's safety net
                    logger.warning("could not renew %d rollout leases: %s", len(leases), err)

    def _admit(self, need: int, round_: int, prefix: str = "round", at_least: int | None = None) -> list[str] | None:
        """Block until the coordinator admits `need` rollouts (or, with `at_least`, as many as it grants once
        that many are in hand: up to `need`); None if stopped or paused first.  Refused, it asks again when this
        process publishes (or releases leases), at the latest after ADMIT_RETRY_S."""
        leases: list[str] = []
        attempt = 0
        while len(leases) < (need if at_least is None else at_least):
            if self._stop.is_set() or self._paused:
                if leases:  # a checkpoint is waiting: give a partial grant back, ask again afterwards
                    self._give_back(leases)
                return None
            # The request id makes a call that Ray retries after a coordinator restart idempotent.
            epoch = self.coordinator.admission_epoch
            granted = self.coordinator.try_admit(need - len(leases), worker="producer",
                                                 request_id=f"{prefix}-{round_}/{attempt}")
            with self._cond:
                self._held.update(granted)
            leases += granted
            attempt += 1
            if not granted:  # refused: admission opens with a publication (or a release)
                self.coordinator.wait_admission(epoch, ADMIT_RETRY_S)
        return leases

    def _give_back(self, leases: list[str]) -> None:
        """Release admitted leases this producer will not use."""
        self.coordinator.release(leases)
        with self._cond:
            self._held.difference_update(leases)

    def _run(self, first_round: int) -> None:
        need = self.coordinator.config.batch_size  # one round = one learner batch
        r = first_round
        last = self.steps + self.coordinator.lookahead  # rounds a longer run would sample before step `steps`
        try:
            while r < last:
                with self._cond:
                    while self._paused and not self._stop.is_set():
                        self._cond.wait(0.1)
                    if self._stop.is_set():
                        return
                    self._busy = True
                try:
                    leases = self._admit(need, r)
                    if leases is None:
                        continue
                    t0 = time.perf_counter()
                    samples, stats = self.sample_round(r)
                    with self._cond:
                        self._ready[r] = Round(r, samples, leases, time.perf_counter() - t0, stats)
                    r += 1
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as err:  # surfaced to the driver on its next call
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def next(self, step: int) -> Round:
        """Round `step` (samples, admission leases, seconds, dynamic sampling's account), waiting for it."""
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("rollout producer stopped without producing round %d" % step)
                self._cond.wait(1.0)
            item = self._ready.pop(step)
            self._held.difference_update(item.leases)
            self._handed = list(item.leases)
        return item

    def pause(self) -> list[Round]:
        """Start no new round, let the one in flight finish; the finished rounds not yet taken."""
        with self._cond:
            self._paused = True
        self.coordinator.wake_admission()
        with self._cond:
            while self._busy and self._error is None and self._thread is not None and self._thread.is_alive():
                self._cond.wait(0.5)
            if self._error is not None:
                raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
            return [self._ready[k] for k in sorted(self._ready)]

    def unpause(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        self._stop.set()
        self.coordinator.wake_admission()
        with self._cond:
            self._cond.notify_all()
        for thread in (self._thread, self._keepalive):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=120)
