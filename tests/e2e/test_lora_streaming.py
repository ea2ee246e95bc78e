"""A streaming LoRA run end to end: adapters published while requests generate, each request on its adapter.

    python -m pytest tests/e2e/test_lora_streaming.py -q

The quickest whole recipe (configs/tiny_cpu_scratch.yaml) with learner.lora.enabled (test_lora_run.py's LORA)
and rollout.streaming on the streaming drills' recipe (async, 200-token responses, 8 sequences at once), 3
steps: publications land while requests generate, and each request keeps the adapter it started with to its
end.  It runs alone (tests/lanes.py): whether an adapter lands while requests are in flight depends on timing,
which another run beside it would change.  A module of its own, so that test_lora_run.py's runs, which read no
timing, may run beside other modules.
"""

from __future__ import annotations

import pytest

from megatron_rl.drill.streaming import STREAMING
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli
from tests.e2e.test_lora_run import LORA

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.alone("its streaming run asserts adapters swapped while requests were in flight")]


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_stream") / "run"
    out = run_cli("train", "--config", str(TINY), f"run.dir={run_dir}", "run.steps=3", *LORA, *STREAMING)
    return run_dir, last_json(out.stdout)


def test_a_streaming_lora_run_keeps_each_request_on_its_adapter(stream_run):
    import re
    import sqlite3

    from megatron_rl.trajectory import Trajectory

    run_dir, summary = stream_run
    assert summary["steps"] == 3 and summary["training"].startswith("LoRA rank 8")
    log = (run_dir / "logs" / "ray_StreamRolloutWorker.log").read_text()
    kept = [int(n) for n in re.findall(r"refit to version \d+ \(adapter\): (\d+) request\(s\) kept", log)]
    assert len(kept) == 3 and max(kept) > 0, kept  # adapters published while requests generated
    for version in (1, 2, 3):
        assert f"refit check of version {version}: median" in log
    rows = [r for r in read_jsonl(run_dir / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["learn/quarantined_trajectories"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["system/stream_multi_version_fraction"] == 0.0 for r in rows)  # nobody switched adapters
    with sqlite3.connect(run_dir / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    digests: dict[str, set] = {}
    for t in trajs:  # one version per sequence, one publication per version
        assert len(set(t.policy_versions.tolist())) == 1 and len(t.segments) == 1, (t.id, t.segments)
        for v, digest in t.weights.items():
            digests.setdefault(v, set()).add(digest)
    assert trajs and all(len(found) == 1 for found in digests.values()), digests
