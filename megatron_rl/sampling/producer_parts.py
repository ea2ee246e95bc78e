"""The two parts every rollout producer holds -- the round producer (producer.py) and the streaming one
(stream_producer.py) each own one of each; neither inherits from the other:

    thread = ProducerThread("rollout-producer")    # the background loop: pause, errors, stop
    leases = Leases(coordinator, quit=thread.quit_asked)
    leases.keep_alive(thread.stopping)             # renews what is held every lease_ttl_s / 3
    granted = leases.admit(8, round_=3)            # blocks until admitted; None once paused or stopped
    leases.hand_out(granted)                       # to the driver: renewed until the next hand-out
    leases.give_back(granted)                      # not used after all: released at the coordinator

The coordinator decides admission (coordinator/admission.py); these parts only ask, keep and return.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)

ADMIT_RETRY_S = 0.25  # a refused producer asks again this often at least (leases expire, other processes)


class ProducerThread:
    """A producer's background thread and its state: paused (a checkpoint), busy (between an admission and a
    result the checkpoint must wait for), stopping, and the error it died of (raised to the driver)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.paused = False
        self.busy = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, target: Callable, *args) -> None:
        self.thread = threading.Thread(target=target, args=args, name=self.name, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def quit_asked(self) -> bool:
        """Stop asking for admissions: the run stops, or a checkpoint waits."""
        return self.stopping.is_set() or self.paused

    def idle(self) -> None:
        """The work a checkpoint waits for is submitted or given back (the end of a loop turn)."""
        with self.cond:
            self.busy = False
            self.cond.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = err
            self.cond.notify_all()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error

    def pause(self, wake: Callable[[], None], busy: Callable[[], bool]) -> None:
        """Admit nothing new, and wait while `busy()` (asked holding `cond`) says that work a checkpoint must
        contain is still in flight."""
        with self.cond:
            self.paused = True
        wake()
        with self.cond:
            while busy() and self.error is None:
                self.cond.wait(0.5)
            self.raise_if_failed()

    def unpause(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def stop(self, wake: Callable[[], None], *others: threading.Thread | None) -> None:
        self.stopping.set()
        wake()
        with self.cond:
            self.cond.notify_all()
        for thread in (self.thread, *others):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=120)


class Leases:
    """The admission leases a producer holds: asked for, renewed while held or just handed out, given back."""

    def __init__(self, coordinator, quit: Callable[[], bool]) -> None:
        self.coordinator = coordinator
        self.quit = quit
        self._lock = threading.Lock()
        self.held: set[str] = set()  # admitted and not yet handed to the driver
        self.handed: list[str] = []  # the batch last handed out (enqueued soon)
        self.keepalive: threading.Thread | None = None

    def hold(self, leases) -> None:
        """Leases admitted before (a checkpoint's saved rounds): renewed from now on."""
        with self._lock:
            self.held.update(leases)

    def hand_out(self, leases: list[str]) -> None:
        with self._lock:
            self.held.difference_update(leases)
            self.handed = list(leases)

    def keep_alive(self, stopping: threading.Event) -> None:
        self.keepalive = threading.Thread(target=self._renew, args=(stopping,), name="lease-keepalive", daemon=True)
        self.keepalive.start()

    def _renew(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.coordinator.config.lease_ttl_s / 3):
            with self._lock:
                leases = sorted(self.held.union(self.handed))
            if leases:
                try:
                    self.coordinator.renew(leases)
                except Exception as err:  # the next beat retries; expiry is the coordinator's safety net
                    logger.warning("could not renew %d rollout leases: %s", len(leases), err)

    def admit(self, need: int, round_: int, prefix: str = "round", at_least: int | None = None) -> list[str] | None:
        """Block until the coordinator admits `need` rollouts (or, with `at_least`, as many as it grants once
        that many are in hand: up to `need`); None if `quit()` first (a partial grant is given back: a checkpoint
        waits, it asks again afterwards).  Refused, it asks again when this process publishes (or releases
        leases), at the latest after ADMIT_RETRY_S."""
        leases: list[str] = []
        attempt = 0
        while len(leases) < (need if at_least is None else at_least):
            if self.quit():
                if leases:
                    self.give_back(leases)
                return None
            # The request id makes a call that Ray retries after a coordinator restart idempotent.
            epoch = self.coordinator.admission_epoch
            granted = self.coordinator.try_admit(need - len(leases), worker="producer",
                                                 request_id=f"{prefix}-{round_}/{attempt}")
            self.hold(granted)
            leases += granted
            attempt += 1
            if not granted:  # refused: admission opens with a publication (or a release)
                self.coordinator.wait_admission(epoch, ADMIT_RETRY_S)
        return leases

    def give_back(self, leases: list[str]) -> None:
        """Release admitted leases this producer will not use."""
        self.coordinator.release(leases)
        with self._lock:
            self.held.difference_update(leases)
