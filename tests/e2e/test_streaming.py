"""Streaming rollouts with in-flight refit in a real training run, and resume (issue 27).

    python -m pytest tests/e2e/test_streaming.py -q

The tiny recipe in async mode with rollout.streaming on and long responses (200 tokens, EOS ignored), so
that generation outlasts a learner step and publications land while requests are in flight.  Run A
trains 3 steps and checkpoints with prompt groups in flight (the checkpoint lets them finish and saves
the finished ones); B resumes the same run directory to step 5.  What must hold:
- refits happen with requests kept (recompute mode), and no request is lost or trained twice;
- tokens of one sequence carry more than one version, each version backed by one publication digest,
  recorded as segments whose KV epoch is their own version (recompute);
- the learner checked every consumed token's digest (train/policy.py quarantine: a mismatch
  is kept out of the loss and counted).
"""

from __future__ import annotations

import re
import sqlite3

import pytest

from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAM = ["run.mode=async", "run.prompts_per_step=4", "run.group_size=4", "learner.micro_batch_size=16",
          "run.eval_every=0", "run.checkpoint_every=3", "data.eval_size=8", "rollout.streaming=true",
          "rollout.inflight_refit=recompute", "rollout.max_tokens=200", "rollout.max_model_len=256",
          "rollout.ignore_eos=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "run"
    a = last_json(run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=3", *STREAM).stdout)
    b = last_json(run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=5", *STREAM).stdout)
    return d, a, b


def test_the_run_resumes_and_finishes(run):
    d, a, b = run
    assert (a["steps"], a["version"]) == (3, 3)
    assert (b["steps"], b["version"]) == (5, 5)
    consumed = [i for row in read_jsonl(d / "consumed.jsonl") for i in row["ids"]]
    assert len(consumed) == 5 * 4 * 4 and len(set(consumed)) == len(consumed)  # nothing trained twice


def test_publications_landed_while_requests_were_in_flight(run):
    d, _, _ = run
    log = (d / "logs" / "ray_StreamRolloutWorker.log").read_text()
    kept = [int(n) for n in re.findall(r"refit to version \d+ \(recompute\): (\d+) request\(s\) kept", log)]
    assert len(kept) >= 5, log[-3000:]
    assert max(kept) > 0, f"no refit kept a request in flight: {kept}"
    metrics = read_jsonl(d / "metrics" / "metrics.jsonl")
    assert max(m.get("system/stream_multi_version_fraction", 0.0) for m in metrics) > 0


def test_every_token_names_the_publication_that_sampled_it(run):
    d, _, _ = run
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    assert trajs
    digests: dict[str, set] = {}
    for t in trajs:
        versions = {str(v) for v in t.policy_versions.tolist()}
        assert versions == set(t.weights), (t.id, versions, t.weights)
        for v, digest in t.weights.items():
            digests.setdefault(v, set()).add(digest)
    assert all(len(found) == 1 for found in digests.values()), digests  # one publication per version
    assert all(found != {"disk"} for v, found in digests.items() if v != "0"), digests
    assert any(len(set(t.policy_versions.tolist())) > 1 for t in trajs), "no sequence spans two versions"
    # Segments: one per version switch; in recompute mode every kept request's KV was recomputed.
    for t in trajs:
        assert len(t.segments) == 1 + int((t.policy_versions[1:] != t.policy_versions[:-1]).sum()), t.segments
        assert (t.kv_versions == t.policy_versions).all(), t.segments
