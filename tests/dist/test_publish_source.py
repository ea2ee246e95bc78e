"""The Megatron side of weight publication: TP2 x PP2 learner ranks rebuild the full HF model.

    python -m pytest tests/dist/test_publish_source.py -q

Four gloo ranks (TP=2, PP=2) load a tiny Qwen2 checkpoint (QKV bias, GQA) through the shared
conversion mapping, then `LearnerWorker.hf_state()` gathers TP shards and pipeline stages on
rank 0 and maps them back to HF names, group by group (MegatronWeightSource): every tensor of the original checkpoint must come back,
none missing, none duplicated, none extra (vocabulary padding removed), bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _publish_source(rank: int, world_size: int, hf_dir: str):
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner import LearnerConfig
    from megatron_rl.ranks.rank import LearnerWorker, RankSpec

    cfg = LearnerConfig(tensor_parallel_size=2, pipeline_parallel_size=2, global_batch_size=2)
    worker = LearnerWorker(rank=rank, world_size=world_size)
    spec = RankSpec(learner=cfg, loss=GRPOLossConfig(), hf_dir=hf_dir, seed=0, deterministic=True, threads=1)
    worker.setup("127.0.0.1", 0, spec)  # torch.distributed is already up in this child
    source = worker.weight_source()
    streamed = list(source)  # [(hf_name, tensor)] in stream order on rank 0, [] elsewhere
    return worker.hf_state(), streamed, source.metadata()


def test_tp2_pp2_learner_publishes_the_complete_model(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2", size="tiny", seed=3)
    original = load_file(str(hf_dir / "model.safetensors"))
    results = run_distributed(_publish_source, 4, str(hf_dir), timeout=600)
    assert all(r[0] is None and r[1] == [] for r in results[1:]), "only rank 0 holds the published state"
    published, streamed, metadata = results[0]
    # The stream agrees with metadata() element by element (the contract vLLM's NCCL engine relies on).
    assert [(n, t.dtype, tuple(t.shape)) for n, t in streamed] == [(n, d, tuple(s)) for n, d, s in metadata]
    assert all(r[2] == metadata for r in results[1:])
    assert sorted(published) == sorted(original)
    for name, tensor in original.items():
        assert published[name].shape == tensor.shape, name
        assert torch.equal(published[name], tensor), name


def _publish_moe_source(rank: int, world_size: int, hf_dir: str):
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner import LearnerConfig
    from megatron_rl.ranks.rank import LearnerWorker, RankSpec

    cfg = LearnerConfig(pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2, global_batch_size=2)
    worker = LearnerWorker(rank=rank, world_size=world_size)
    spec = RankSpec(learner=cfg, loss=GRPOLossConfig(), hf_dir=hf_dir, seed=0, deterministic=True, threads=1)
    worker.setup("127.0.0.1", 0, spec)
    local = [n for n in worker.weight_source().params if n.endswith("linear_fc2.weight") and "local_experts" in n]
    return worker.hf_state(), len(local)


def test_ep2_pp2_moe_learner_publishes_every_expert(tmp_path):
    """PP2 x DP2 with EP2: each rank holds half of each layer's experts; DP replica 0 of each
    stage gathers the rest from its EP peer, and rank 0 gets all 8 experts of every layer."""
    from megatron_rl.models.tiny import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", size="tiny", seed=3)
    original = load_file(str(hf_dir / "model.safetensors"))
    results = run_distributed(_publish_moe_source, 4, str(hf_dir), timeout=600)
    assert all(r[0] is None for r in results[1:]), "only rank 0 holds the published state"
    assert [r[1] for r in results] == [4] * 4  # one layer per stage, 4 of its 8 experts per rank
    published = results[0][0]
    assert sorted(published) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(published[name], tensor), name
    assert any(".mlp.experts.7.down_proj." in n for n in published)
