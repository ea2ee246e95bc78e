"""Rollout rounds, produced as far ahead as the coordinator admits.

    producer = Producer(roles); producer.start(state)
    samples, leases, seconds = producer.next(step)    # one round = one learner batch
    producer.stop()   # the coordinator's version, set on publish, opens admission

One background thread runs rounds in order: ask the coordinator for B admissions (the
admission rule (max_staleness + v + 1) x B - (accepted + running) > 0 bounds staleness before
any compute is spent), take the round's prompts from the data cursor, generate on the rollout
fleet, and hand the samples to the driver.  The run mode only sets how far ahead it may go:

  sync          max_staleness 0: round s starts after version s is published (on-policy)
  one_step_off  max_staleness 1: round s+1 samples with version s while step s learns
  async         max_staleness k: up to k versions ahead

so the same code serves every mode and the coordinator remains the single place that
decides.  Rounds are numbered like steps; per-request sampling seeds derive from the run seed
and the round, so a resumed sync run draws exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainState:
    step: int
    version: int


@dataclasses.dataclass
class Round:
    index: int
    samples: list
    leases: list
    seconds: float


class Producer:
    def __init__(self, roles):
        self.roles = roles
        self.cfg = roles.cfg
        self._rounds: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Data cursor as it was before each round drew its prompts: a checkpoint taken after
        # step s resumes the cursor at round s, even if later rounds were already drawn.
        self.cursor_before: dict[int, dict] = {}

    def start(self, state: TrainState) -> None:
        self._thread = threading.Thread(target=self._run, args=(state.step,), name="rollout-producer", daemon=True)
        self._thread.start()

    def _admit(self, need: int) -> list[str]:
        """Block until the coordinator admits `need` rollouts (or we are stopped)."""
        import ray

        leases: list[str] = []
        while len(leases) < need and not self._stop.is_set():
            leases += ray.get(self.roles.coordinator.try_admit.remote(need - len(leases), worker="producer"))
            if len(leases) < need:
                time.sleep(0.02)
        return leases

    def _run(self, first_round: int) -> None:
        cfg = self.cfg
        need = self.roles.cfg.samples_per_step
        try:
            for r in range(first_round, cfg.run.steps):
                leases = self._admit(need)
                if self._stop.is_set():
                    return
                self.cursor_before[r] = self.roles.cursor.state_dict()
                self.cursor_before.pop(r - 2 * (cfg.coordinator.max_staleness + 2), None)
                prompts, extra = self.roles.next_prompts(r)
                t0 = time.perf_counter()
                samples = self.roles.fleet.generate(
                    prompts, n=cfg.run.group_size, extra=extra,
                    sampling={"seed": cfg.run.seed * 1_000_000_007 + r * 7919})
                self._rounds.put(Round(r, samples, leases, time.perf_counter() - t0))
        except BaseException as err:  # surfaced to the driver on its next call
            self._error = err
            self._rounds.put(None)

    def next(self, step: int) -> tuple[list, list, float]:
        """The samples (and their admission leases) of round `step`, waiting for them."""
        while True:
            try:
                item = self._rounds.get(timeout=1.0)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._error is None:
                    raise RuntimeError("rollout producer stopped without producing round %d" % step)
                continue
            if item is None:
                raise RuntimeError(f"rollout producer failed: {self._error!r}") from self._error
            if item.index != step:
                raise RuntimeError(f"rollout round {item.index} arrived for step {step}")
            return item.samples, item.leases, item.seconds

    def cursor_for_round(self, r: int) -> dict:
        """The data cursor a run resuming at round r must start from."""
        return self.cursor_before.get(r, self.roles.cursor.state_dict())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=120)
