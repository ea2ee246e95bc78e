"""The coordinator under load (issue #12 acceptance, short form): 8 producers, 2 consumers,
30 s of load with random SIGKILLs of the real coordinator actor (one every 4-8 s: about 4, and at least 2
land by about 16 s plus the restarts); 0 lost, 0 duplicated.

    python -m pytest tests/e2e/test_coordinator_load.py -q

Runs benchmarks/coordinator_load.py (see its docstring for how ids are counted) in a
subprocess; the full benchmark is the same script with --duration 120 or more.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sigkills_under_load_lose_nothing_and_duplicate_nothing():
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "benchmarks/coordinator_load.py", "--duration", "30", "--producers", "8",
                           "--consumers", "2", "--kill-every", "4", "8", "--seed", "1", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {proc.returncode})\n{proc.stderr[-4000:]}"
    out = json.loads(lines[-1])
    assert out["errors"] == [] and out["hung_threads"] == [], out
    assert out["kills"] >= 2 and out["restarts_seen"] == out["kills"], out  # every kill answered by a new actor
    assert out["acknowledged"] > 0 and out["consumed"] > 0, out
    assert out["lost"] == 0, out
    assert out["duplicated"] == 0, out
    assert out["still_queued"] == 0 and out["consumed"] == out["acknowledged"], out  # the consumers drained it
    assert proc.returncode == 0, proc.stderr[-4000:]
