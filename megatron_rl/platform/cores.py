"""CPU cores of a role's own: on a machine without GPUs, the stand-in for giving each role devices of its own.

    cores = parse_cores("0,2-3", "learner.cpu_cores")    # {0, 2, 3}; ValueError naming the field otherwise
    confine_process(cores, allowed, "learner.cpu_cores")   # every thread of this process, and those it starts

By default a learner rank and a rollout engine on CPU share every core, so a "disaggregated" placement
(train/placement.py) is a name only: both roles still contend for the same cores.  `learner.cpu_cores` and
`rollout.cpu_cores` give each role a set of cores; Linux affinity is per thread, so every thread the process
has is moved and threads and processes started later (torch's OpenMP pool, vLLM's engine processes) inherit
it.  A learner actor handed to a later run (train/engine_pool.py) is moved to that run's cores, or back to
the cores it started with.
"""

from __future__ import annotations

import os


def parse_cores(text: str, field: str) -> set[int]:
    """Core ids of a list like "0", "0-1" or "0,2-3"; ValueError naming `field` for anything else (whether the
    cores exist is known only where the role runs: confine_process)."""
    cores: set[int] = set()
    for part in str(text).split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{field}: {text!r} is not a core list like '0', '0-1' or '0,2-3'") from None
        if first < 0 or last < first:
            raise ValueError(f"{field}: {part.strip()!r} in {text!r} is not a range of core ids")
        cores.update(range(first, last + 1))
    return cores


def format_cores(cores: set[int]) -> str:
    """"0-3,6": the form parse_cores reads and vLLM's VLLM_CPU_OMP_THREADS_BIND takes."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def confine_process(cores: set[int], allowed: set[int], field: str) -> None:
    """Every thread of this process on `cores` (threads that end meanwhile are skipped); ValueError naming
    `field` when they are not among `allowed` (the cores the process started with)."""
    if not cores <= allowed:
        raise ValueError(f"{field}: core(s) {format_cores(cores - allowed)} are not among the cores this process "
                         f"may run on ({format_cores(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass
