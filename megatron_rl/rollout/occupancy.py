"""How busy a streaming engine was: time-weighted running requests against its capacity.

    occ = Occupancy(capacity=256)          # the engine's max_num_seqs (StreamEngine)
    occ.change(len(flights))               # whenever the number of requests in flight changes
    occ.take()  # {"occupancy": 0.83, "idle_fraction": 0.05, "seconds": 1.9}: since the last take, then reset

    feed = RunningFeed()                   # or: what vLLM's scheduler ran, step by step
    AsyncLLM.from_engine_args(args, stat_loggers=[feed.factory()]); feed.attach(occ)

occupancy       mean over the window of min(running, capacity) / capacity: 1.0 when the engine ran full
                batches all the time (requests past the capacity wait in vLLM's queue: they add nothing)
idle_fraction   share of the window with nothing running at all (the engine had nothing to do)

Two sources, one per Occupancy.  Fed by a RunningFeed (what StreamEngine.start builds), "running" is vLLM's
scheduler's count after each engine step (SchedulerStats.num_running_reqs, finished requests removed), held
until the next step; a paused engine (a refit, a roll-back, an adapter session) runs nothing (`paused`).  Without a feed (an engine built
elsewhere), "running" is the requests in flight from admission to last token, which counts requests vLLM
keeps waiting (KV blocks short, or paused): an upper bound.  The window is the time between two `take`
calls (the driver asks once per learner step).
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
        self.source = "flights"
        """"flights" (change() counts admitted requests) or "scheduler" (a RunningFeed counts what ran)."""

    def change(self, in_flight: int, source: str = "flights") -> None:
        """`in_flight` requests run from now on, as counted by `source` (ignored unless it is this one's)."""
        if source != self.source:
            return
        with self._lock:
            self._advance()
            self._n = int(in_flight)

    def paused(self) -> None:
        """The engine was paused: a scheduler-fed figure reads 0 until vLLM steps again."""
        self.change(0, source="scheduler")

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


class RunningFeed:
    """Hands vLLM's scheduler count of running requests, after every engine step, to an Occupancy.  Its
    factory is a stat logger for AsyncLLM (vLLM's `stat_loggers` API); it drops what comes before `attach`."""

    def __init__(self):
        self.target: Occupancy | None = None

    def attach(self, occupancy: Occupancy) -> None:
        occupancy.source = "scheduler"
        self.target = occupancy

    def factory(self) -> type:
        from vllm.v1.metrics.loggers import StatLoggerBase

        feed = self

        class RunningRequests(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None and feed.target is not None:
                    feed.target.change(scheduler_stats.num_running_reqs, source="scheduler")

            def log_engine_initialized(self):
                pass

        return RunningRequests
