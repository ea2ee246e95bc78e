"""Engine occupancy for the engine-level benchmarks: how full vLLM's running batch was, time-weighted.

    from engine_occupancy import Occupancy       # a sibling module: run the benchmarks as scripts
    occupancy = Occupancy(llm.llm_engine)        # or a StreamEngine's AsyncLLM (stream.engine); needs
                                                 # the engine started with disable_log_stats=False
    ...
    occupancy.mean(start, end, capacity)         # running requests / capacity over [start, end]
    occupancy.mean_over(intervals, capacity)     # the same, over a union of (start, end) intervals

Used by benchmarks/stream_throughput.py and benchmarks/multiturn_throughput.py.  Every engine step
vLLM hands its scheduler stats to the engine's stat-logger manager; this wraps that manager's
`record` and keeps (time, running requests) of each step.  A sample holds until the next one (vLLM
counts running requests after it removed the step's finished ones, so an idle engine reads 0).
"""

from __future__ import annotations

import bisect
import time


class Occupancy:
    """Wraps an engine's stat-logger manager: (time, running requests) at every engine step."""

    def __init__(self, engine):
        self.samples: list[tuple[float, int]] = []
        manager = engine.logger_manager
        record = manager.record

        def recording(*a, scheduler_stats=None, **kw):
            if scheduler_stats is not None:
                self.samples.append((time.perf_counter(), scheduler_stats.num_running_reqs))
            return record(*a, scheduler_stats=scheduler_stats, **kw)

        manager.record = recording

    def mean(self, start: float, end: float, capacity: int) -> float:
        """Time-weighted mean of running/capacity over [start, end] (each sample holds until the next)."""
        pts = [(t, n) for t, n in self.samples if start <= t <= end]
        if not pts:
            return 0.0
        pts.append((end, pts[-1][1]))
        area = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(pts, pts[1:]))
        return area / max(end - pts[0][0], 1e-9) / capacity

    def mean_over(self, intervals: list[tuple[float, float]], capacity: int) -> float:
        """Time-weighted mean of running/capacity over a set of intervals (overlaps counted once); the
        value at a time is the last sample at or before it (time before the first sample is skipped)."""
        times = [t for t, _ in self.samples]
        area = covered = 0.0
        for lo, hi in union(intervals):
            i = bisect.bisect_right(times, lo) - 1  # the sample in force at lo
            cuts = [lo, *times[i + 1:bisect.bisect_right(times, hi)], hi]
            for k, (t0, t1) in enumerate(zip(cuts, cuts[1:])):
                if i + k >= 0:
                    area += self.samples[i + k][1] * (t1 - t0)
                    covered += t1 - t0
        return area / max(covered, 1e-9) / capacity


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching intervals merged, sorted."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
