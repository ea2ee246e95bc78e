"""Qwen3-MoE conversion on gloo ranks: HF -> Megatron (TP2 PP2) -> HF bit-exact, the converter's
writer vs Megatron's own save at EP2, and logits vs transformers at TP/PP/EP layouts.

    python -m pytest tests/dist/test_moe_conversion.py -q

One tiny Qwen3-MoE (8 experts, top-2, norm_topk_prob) is made and converted once per module.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf
from megatron_rl.conversion.verify import hf_logits, mcore_logits, sample_tokens
from megatron_rl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    hf = make_tiny_model(root / "hf", arch="qwen3_moe", seed=3)
    return hf, convert_hf_to_mcore(hf, root / "mc", tp=2, pp=2), root


def test_moe_roundtrip_is_bit_exact(converted):
    hf, mc, root = converted
    back = convert_mcore_to_hf(mc, root / "back")
    src, dst = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(src) == sorted(dst)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in src and "model.layers.0.mlp.gate.weight" in src
    for name in src:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    assert json.loads((hf / "config.json").read_text()) == json.loads((back / "config.json").read_text())


def test_moe_logits_match_transformers_at_tp_pp_ep(converted):
    hf, mc, _ = converted
    tokens = sample_tokens(100, batch=2, seq_len=12, seed=1)
    ref = hf_logits(hf, tokens)  # [B, T, V]
    layouts = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]
    got = mcore_logits(mc, tokens, layouts)
    assert sorted(got) == sorted(layouts)
    for layout, logits in got.items():
        err = (logits - ref).abs().max().item()
        assert err < 1e-4, f"qwen3_moe at TP/PP/EP {layout}: max abs logit diff {err}"
    base = got[(1, 1, 1)]
    for layout, logits in got.items():  # the layouts agree with each other as tightly as with HF
        assert (logits - base).abs().max().item() < 1e-5, layout


def _megatron_save_rank(rank: int, world_size: int, hf_dir: str, out: str, ep: int) -> None:
    """Reference: the model at EP=ep filled from HF, saved by Megatron-Core's dist_checkpointing."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.conversion.model_io import fill_from_hf
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config, padded_vocab_size
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(hf_dir)
    with parallel_scope(tp=1, pp=1, ep=ep):
        model = build_gpt_model(cfg, platform=detect_platform("cpu", "fp32"), tp=1, pp=1, perform_initialization=False)
        fill_from_hf(model, cfg, HFCheckpoint(hf_dir, cfg), 0, 1, padded_vocab_size(cfg.vocab_size, 1))
        proc = multiprocessing.current_process()
        daemon, proc.daemon = proc.daemon, False  # save forks writer processes; spawned ranks are daemonic
        try:
            dist_checkpointing.save(model.sharded_state_dict(), out,
                                    sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
        finally:
            proc.daemon = daemon


def test_moe_writer_matches_megatron_save_at_ep2(converted, tmp_path):
    """Same keys (expert axis, expert extra state), shapes, dtypes and values as Megatron's save at EP2,
    so the expert-parallel ranks each filled and wrote only their own experts."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_rl.conversion import mapping
    from megatron_rl.conversion.dist_ckpt import DistCheckpointReader
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform.spawn import run_distributed

    hf, _, _ = converted
    ours = convert_hf_to_mcore(hf, tmp_path / "mc1", tp=1) / "weights"
    theirs = tmp_path / "megatron"
    theirs.mkdir()
    run_distributed(_megatron_save_rank, 2, str(hf), str(theirs), 2)
    md_ours, md_theirs = (FileSystemReader(str(d)).read_metadata().state_dict_metadata for d in (ours, theirs))
    assert sorted(md_ours) == sorted(md_theirs)
    assert md_theirs["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size == (2, 8, 256, 128)
    for key, entry in md_theirs.items():
        if isinstance(entry, TensorStorageMetadata):
            assert md_ours[key].size == entry.size and md_ours[key].properties.dtype == entry.properties.dtype, key
    r_ours, r_theirs = DistCheckpointReader(ours), DistCheckpointReader(theirs)
    for e in mapping.name_table(load_hf_config(hf)):
        assert torch.equal(r_ours.tensor(e.mcore), r_theirs.tensor(e.mcore)), e.mcore


def test_router_without_norm_topk_prob_matches_transformers(converted, tmp_path):
    """Qwen3-MoE with norm_topk_prob false weights the top-k experts by their full-softmax probabilities
    (unrenormalised); the builder switches Megatron's router to softmax-before-top-k for it."""
    import shutil

    hf, _, _ = converted
    plain = tmp_path / "hf_plain"
    shutil.copytree(hf, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(config | {"norm_topk_prob": False}))
    mc = convert_hf_to_mcore(plain, tmp_path / "mc_plain")
    tokens = sample_tokens(100, batch=2, seq_len=12, seed=2)
    ref = hf_logits(plain, tokens)
    got = mcore_logits(mc, tokens, [(1, 1, 2)])[(1, 1, 2)]
    assert (got - ref).abs().max().item() < 1e-4
    assert (got - hf_logits(hf, tokens)).abs().max().item() > 1e-2  # the two router rules differ here
