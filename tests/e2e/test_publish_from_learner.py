"""A TP=2 Megatron learner publishes to TP=1 and TP=2 vLLM rollout groups; they agree to 1e-4.

The TP=2 group is exercised with Llama-3.x (rope scaling, which is a Llama otherwise: the Llama
mapping and TP gather, so one run covers both the plain Llama publication and the rope-scaled config);
the TP=1 group with Qwen3 (q/k norm with its own head_dim) and Qwen3-MoE, whose TP2 learner runs
sequence parallel and splits each expert over the two ranks.  The Qwen3 model ties its embeddings
(as Qwen3-0.6B and Qwen2.5-1.5B): the learner's output layer is its embedding
(share_embeddings_and_output_weights), the publication carries `model.embed_tokens.weight` and no
`lm_head.weight`, and vLLM's LM head is the embedding it reloads.  Step 1's update changes that
weight, so an engine whose head still held the start-up weights would miss the learner at step 2:
without publish/vllm_reload.refresh_tied_heads (vLLM's CPU head keeps a prepacked copy) D_lag p99
was 0.056, 560 times the bound, while the refit check's median still let it through.  A publication
that skipped the shared tensor or added an `lm_head.weight` is refused by the completeness check,
and the run fails; one that put another tensor there fails D_lag the same way.

The same two-step GRPO run trains each tiny model end to end on CPU and publishes it.  Qwen3-MoE
(8 experts, top-2) trains three steps on an expert-parallel learner (DP2, EP2: each rank holds 4
of each layer's experts, gathered over the EP group for publication) into vLLM's CPU MoE, whose
refit must re-prepare the experts (publish/vllm_engine.disarm_moe_kernels): every version is
accepted and served.

    python -m pytest tests/e2e/test_publish_from_learner.py -q

Two real training steps per layout: the initial policy is loaded by both sides from the HF
checkpoint, the learner updates it and publishes version 1 (TP shards gathered, mapped to HF
names, checksummed buckets over gloo into vLLM's weight-transfer engine), then step 2 samples
with version 1.  Before each update the learner scores the sampled tokens itself; the
per-sequence D_lag = mean |log pi_learner - log mu_vLLM| must stay below 1e-4, so every token
sampled after the switch came from the new weights.
"""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from tests.e2e.conftest import TINY, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("arch,rollout_tp,tied", [("llama3", 2, False), ("qwen3", 1, True), ("qwen3_moe", 1, False)])
def test_tp2_learner_publishes_to_rollout_group(tmp_path, arch, rollout_tp, tied):
    run_cli("train", "--config", str(TINY), f"run.dir={tmp_path}", "run.steps=2", "run.eval_every=0",
            "run.checkpoint_every=0", "learner.tensor_parallel_size=2",
            f"rollout.tensor_parallel_size={rollout_tp}", f"model.tiny.arch={arch}",
            f"model.tiny.tie_embeddings={'true' if tied else 'false'}",
            # a TP2 group's two workers are vLLM processes of their own
            f"rollout.engine_in_process={'true' if rollout_tp == 1 else 'false'}")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    with safe_open(str(tmp_path / "model" / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied  # tied: the embedding is the only output layer
    assert config["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(
        arch, "LlamaForCausalLM")]
    assert (config.get("rope_parameters") or {}).get("rope_type", "default") == ("llama3" if arch == "llama3" else "default")
    rows = [r for r in read_jsonl(tmp_path / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["learn/loss"]) for r in rows)
    assert rows[1]["queue/taken_dv/p99"] == 0  # step 2 sampled with the published version 1
    for r in rows:
        assert r["learn/d_lag/p99"] < 1e-4, r["learn/d_lag/p99"]


def test_ep2_moe_learner_trains_and_publishes(tmp_path):
    proc = run_cli("train", "--config", str(TINY), f"run.dir={tmp_path}", "run.steps=3", "run.eval_every=0",
                   "run.checkpoint_every=0", "model.tiny.arch=qwen3_moe", "learner.data_parallel_size=2",
                   "learner.expert_parallel_size=2", "learner.micro_batch_size=32")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 3  # every publication was accepted by the refit check
    rows = [r for r in read_jsonl(tmp_path / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["learn/loss"]) for r in rows)
    assert all(r["queue/taken_dv/p99"] == 0 for r in rows)  # step k sampled with version k-1
    for r in rows:  # vLLM's logprobs of the sampled tokens == the EP2 learner's
        assert r["learn/d_lag/p99"] < 1e-4, r["learn/d_lag/p99"]
    rewards = [r["learn/reward_mean"] for r in rows]
    assert rewards[-1] > rewards[0], rewards
