"""Helpers for end-to-end tests that run the real `megatron-rl` CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu_scratch.yaml"  # GRPO from a random tiny model: the quickest whole run


def run_cli(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"megatron-rl {' '.join(args)} exited {proc.returncode}\n--- stderr tail ---\n"
                    f"{proc.stderr[-6000:]}")
    return proc


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout[-2000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
