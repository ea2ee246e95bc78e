"""How busy a streaming engine was: time-weighted requests in flight against its capacity.

    occ = Occupancy(capacity=256)          # the engine's max_num_seqs (StreamEngine)
    occ.change(len(flights))               # whenever the number of requests in flight changes
    occ.take()  # {"occupancy": 0.83, "idle_fraction": 0.05, "seconds": 1.9}: since the last take, then reset

occupancy       mean over the window of min(in flight, capacity) / capacity: 1.0 when the engine ran full
                batches all the time (requests past the capacity wait in vLLM's queue: they add nothing)
idle_fraction   share of the window with no request in flight at all (the engine had nothing to do)

Requests in flight are counted from their admission to their last token; a request vLLM keeps waiting
(KV blocks short, or paused for a refit) counts as running, so the figure is an upper bound on what vLLM's
scheduler ran.  The window is the time between two `take` calls (the driver asks once per learner step).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Occupancy:
    """Integrates the number of requests in flight over time (thread-safe)."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise ValueError(f"an engine's capacity is at least one sequence, got {capacity}")
        self.capacity, self.clock = int(capacity), clock
        self._lock = threading.Lock()
        self._n = 0
        self._since = self._window = clock()
        self._busy = self._idle = 0.0  # sequence-seconds (capped at capacity), seconds with nothing in flight

    def change(self, in_flight: int) -> None:
        """The number of requests in flight is now `in_flight`."""
        with self._lock:
            self._advance()
            self._n = int(in_flight)

    def take(self) -> dict[str, float]:
        """The window since the last take (or the start): occupancy, idle fraction, its seconds; then a new one."""
        with self._lock:
            self._advance()
            seconds = self._since - self._window
            out = {"occupancy": self._busy / (self.capacity * seconds) if seconds > 0 else 0.0,
                   "idle_fraction": self._idle / seconds if seconds > 0 else 0.0, "seconds": seconds}
            self._window, self._busy, self._idle = self._since, 0.0, 0.0
            return out

    def _advance(self) -> None:
        now = self.clock()
        dt = max(now - self._since, 0.0)
        self._busy += min(self._n, self.capacity) * dt
        if self._n == 0:
            self._idle += dt
        self._since = now
