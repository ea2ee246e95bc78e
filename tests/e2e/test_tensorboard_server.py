"""A real `tensorboard` server on a run directory serves the custom-scalars layout and the series.

    python -m pytest tests/e2e/test_tensorboard_server.py -q

The run directory is written by the project's MetricsLogger (tests/unit/test_report.py's small
run).  The server is started on a free port, asked through its HTTP API for the custom-scalars
layout (/data/plugin/custom_scalars/layout) and for scalar series
(/data/plugin/scalars/scalars), and stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from megatron_rl.platform.spawn import free_port
from tests.unit.test_report import write_run

pytestmark = pytest.mark.e2e


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read().decode())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tb_run")
    write_run(run_dir, steps=5, tensorboard=True)
    port = free_port()
    tb = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(tb), "--logdir", str(run_dir / "metrics" / "tb"), "--host", "127.0.0.1",
                             "--port", str(port), "--reload_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if _get(f"{base}/data/plugin/scalars/tags"):
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tensorboard did not come up: {proc.stderr.read().decode()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: only what this fixture started
        proc.wait(timeout=30)


def test_layout_groups_the_panels_with_percentiles_on_one_chart(server):
    layout = _get(f"{server}/data/plugin/custom_scalars/layout")
    categories = {c["title"]: {ch["title"]: ch["multiline"]["tag"] for ch in c["chart"]} for c in layout["category"]}
    assert {"learn", "numerics", "system", "latency", "queue", "eval"} <= set(categories)
    assert categories["learn"]["D_lag P50/P95/P99"] == ["learn/d_lag/p50", "learn/d_lag/p95", "learn/d_lag/p99"]
    assert categories["queue"]["Δv P50/P95/P99"] == ["queue/taken_dv/p50", "queue/taken_dv/p95", "queue/taken_dv/p99"]
    assert "system/effective_tokens_per_s" in categories["system"]["TPS vs effective TPS"]


def test_scalar_series_are_served_for_every_chart_tag(server):
    tags = _get(f"{server}/data/plugin/scalars/tags")
    (run, run_tags), = tags.items()
    for tag in ("learn/d_lag/p50", "learn/d_lag/p95", "learn/d_lag/p99", "queue/taken_dv/p95", "learn/reward_mean"):
        assert tag in run_tags, tag
    query = urllib.parse.urlencode({"run": run, "tag": "learn/d_lag/p95"})
    points = _get(f"{server}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
    assert [p[1] for p in points] == [1, 2, 3, 4, 5]
    # P95 of (1, 2, 3) x 1e-7 x step, linear interpolation: 2.9e-7 x step (float32 in the event file).
    for _, step, value in points:
        assert value == pytest.approx(2.9e-7 * step, rel=1e-5)
