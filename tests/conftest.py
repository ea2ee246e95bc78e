"""Where the suite's time goes: each test's set-up + call + tear-down, summed per tier (the folder under
tests/: unit, dist, e2e, security, gpu), and the slowest tests, printed at the end of every run and, when
MEGATRON_RL_DURATIONS_OUT names a file, written there too (.ci/run prints that file last).

    MEGATRON_RL_DURATIONS_OUT=durations.txt python -m pytest tests

Budgets per tier are in tests/README.md.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

from tests.lanes import LOCK_WAIT, tier_of

pytest_plugins = ["tests.lanes"]  # two tests at a time under `-n 2` (launch/test.sh): groups, order, `alone`

_SLOWEST = 30
_seconds: dict[str, float] = defaultdict(float)  # nodeid -> set-up + call + tear-down seconds
_outcome: dict[str, str] = {}
_started: list[float] = []
_busy: dict[str, float] = defaultdict(float)  # worker ("gw0", ...; "main" without xdist) -> seconds in its tests
_ended: dict[str, float] = {}  # worker -> seconds from the session's start to its last report
_waits: dict[str, list[tuple[float, str]]] = defaultdict(list)  # worker -> (seconds waited for the lanes lock, test)


def _test_id(nodeid: str) -> str:
    """The test's id without the xdist group suffix ("...::test_x@group")."""
    head, sep, tail = nodeid.rpartition("@")
    return head if sep and "]" not in tail and "::" in head else nodeid


def pytest_runtest_logreport(report):
    nodeid = _test_id(report.nodeid)
    _seconds[nodeid] += report.duration
    worker = getattr(report, "worker_id", None) or "main"
    _busy[worker] += report.duration
    if _started:
        _ended[worker] = time.monotonic() - _started[0]
    if report.when == "call" or report.outcome != "passed":
        _outcome.setdefault(nodeid, report.outcome)
    if report.when == "setup":  # tests/lanes.py: the wait before this test (the same property rides every report)
        _waits[worker] += [(float(v), nodeid) for k, v in getattr(report, "user_properties", ()) if k == LOCK_WAIT]


def durations_table(seconds: dict[str, float], outcome: dict[str, str], slowest: int = _SLOWEST) -> str:
    """Per-tier totals (tests, seconds, minutes) and the `slowest` tests, as plain text."""
    per_tier: dict[str, list[float]] = defaultdict(list)
    for nodeid, s in seconds.items():
        per_tier[tier_of(nodeid)].append(s)
    lines = ["time per tier (set-up + call + tear-down):",
             f"  {'tier':<10} {'tests':>6} {'seconds':>9} {'minutes':>8}"]
    for tier in sorted(per_tier, key=lambda t: -sum(per_tier[t])):
        total = sum(per_tier[tier])
        lines.append(f"  {tier:<10} {len(per_tier[tier]):>6} {total:>9.1f} {total / 60:>8.1f}")
    total = sum(seconds.values())
    lines.append(f"  {'all':<10} {len(seconds):>6} {total:>9.1f} {total / 60:>8.1f}")
    lines.append(f"the {min(slowest, len(seconds))} slowest tests:")
    for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"  {s:8.1f} s  {outcome.get(nodeid, '?'):<7} {nodeid}")
    return "\n".join(lines)


def worker_lines(busy: dict[str, float], ended: dict[str, float],
                 waits: dict[str, list[tuple[float, str]]] | None = None) -> list[str]:
    """Per worker: the time inside its tests, when its last test ended, and the rest of that time (start-up,
    waiting for a lock or for work): where two workers lose time to each other.  With `waits` (tests/lanes.py's
    lock), how much of the idle time was spent waiting for the lock, and before which tests the longest waits."""
    lines = []
    for worker in sorted(busy):
        end = ended.get(worker, busy[worker])
        line = (f"  {worker:<6} in tests {busy[worker] / 60:5.1f} min, last test ended at {end / 60:5.1f} min, "
                f"idle {max(end - busy[worker], 0.0) / 60:4.1f} min")
        mine = sorted((waits or {}).get(worker, ()), key=lambda w: -w[0])  # longest first; ties in order
        if mine:
            line += f" (waiting for the lanes lock {sum(s for s, _ in mine) / 60:4.1f} min)"
        lines.append(line)
        lines += [f"           waited {s:6.1f} s before {nodeid}" for s, nodeid in mine[:3]]
    return lines


def pytest_sessionstart(session):
    _started.append(time.monotonic())


def pytest_terminal_summary(terminalreporter, config):
    if not _seconds:
        return
    workers = config.getoption("numprocesses", None) or 1
    wall = time.monotonic() - _started[0] if _started else 0.0
    table = (f"wall clock: {wall:.0f} s ({wall / 60:.1f} min) on {workers} worker(s); the sums below add up"
             " every worker's time\n" + "\n".join(worker_lines(_busy, _ended, _waits)) + "\n"
             + durations_table(_seconds, _outcome))
    terminalreporter.section("megatron-rl: where the time went")
    terminalreporter.write_line(table)
    out = os.environ.get("MEGATRON_RL_DURATIONS_OUT")
    if out:
        Path(out).write_text(table + "\n")
