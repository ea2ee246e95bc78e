"""HF -> Megatron (TP2 PP2) -> HF round trip and logits at several layouts, on gloo ranks.

    python -m pytest tests/dist/test_conversion.py -q

Per family (llama untied; qwen2 with q/k/v bias and tied embeddings; llama3 rope scaling, tied as
Llama-3.2; qwen3 q/k norm, head_dim 2x hidden/heads, untied as Qwen3-8B): one 4-rank conversion,
one in-process export, one 2-rank launch loading the same checkpoint at TP1, TP2 and PP2.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf
from megatron_rl.conversion.model_io import read_manifest
from megatron_rl.conversion.verify import hf_logits, mcore_logits, sample_tokens
from megatron_rl.models.tiny import make_tiny_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("llama3", True), ("qwen3", False)])
def test_roundtrip_and_logits_across_layouts(tmp_path, arch, tied):
    hf = make_tiny_model(tmp_path / "hf", arch=arch, seed=3, tie_embeddings=tied)
    mc = convert_hf_to_mcore(hf, tmp_path / "mc", tp=2, pp=2)
    manifest = read_manifest(mc)
    assert manifest["written_tp"] == 2 and manifest["written_pp"] == 2
    assert manifest["padded_vocab_size"] == 256 and manifest["vocab_size"] == 128
    assert len(manifest["source_hash"]) == 64 and manifest["tokenizer_hash"]

    back = convert_mcore_to_hf(mc, tmp_path / "back")
    src, dst = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].dtype == dst[name].dtype and torch.equal(src[name], dst[name]), name
    assert json.loads((hf / "config.json").read_text()) == json.loads((back / "config.json").read_text())
    assert (hf / "tokenizer.json").read_bytes() == (back / "tokenizer.json").read_bytes()

    tokens = sample_tokens(100, batch=2, seq_len=12, seed=1)
    ref = hf_logits(hf, tokens)  # [B, T, V]
    layouts = [(1, 1), (2, 1), (1, 2)]
    got = mcore_logits(mc, tokens, layouts)
    assert sorted(got) == sorted(layouts)
    for layout, logits in got.items():
        assert logits.shape == ref.shape, layout
        err = (logits - ref).abs().max().item()
        assert err < 1e-4, f"{arch} at TP{layout[0]} PP{layout[1]}: max abs logit diff {err}"


def _megatron_save_rank(rank: int, world_size: int, hf_dir: str, out: str, tp: int) -> None:
    """Reference: build the model at TP x 1, fill it from HF, let Megatron-Core's dist_checkpointing save it."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.conversion.model_io import fill_from_hf
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config, padded_vocab_size
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(hf_dir)
    with parallel_scope(tp=tp, pp=1):
        model = build_gpt_model(cfg, platform=detect_platform("cpu", "fp32"), tp=tp, pp=1, perform_initialization=False)
        fill_from_hf(model, cfg, HFCheckpoint(hf_dir, cfg), ps.get_tensor_model_parallel_rank(), tp,
                     padded_vocab_size(cfg.vocab_size, tp))
        proc = multiprocessing.current_process()
        daemon, proc.daemon = proc.daemon, False  # save forks writer processes; spawned ranks are daemonic
        try:
            dist_checkpointing.save(model.sharded_state_dict(), out,
                                    sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
        finally:
            proc.daemon = daemon


def test_direct_writer_matches_megatron_save(tmp_path):
    """The converter writes Megatron's own torch_dist format: same keys, shapes, dtypes and values as
    dist_checkpointing.save of the filled model (saved at TP2, so the reader also reassembles TP chunks)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_rl.conversion import mapping
    from megatron_rl.conversion.dist_ckpt import DistCheckpointReader
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform.spawn import run_distributed

    hf = make_tiny_model(tmp_path / "hf", arch="llama", seed=5)
    ours = convert_hf_to_mcore(hf, tmp_path / "mc", tp=2) / "weights"
    theirs = tmp_path / "megatron"
    theirs.mkdir()
    run_distributed(_megatron_save_rank, 2, str(hf), str(theirs), 2)

    md_ours, md_theirs = (FileSystemReader(str(d)).read_metadata().state_dict_metadata for d in (ours, theirs))
    assert sorted(md_ours) == sorted(md_theirs)
    for key, entry in md_theirs.items():
        assert type(md_ours[key]) is type(entry), key
        if isinstance(entry, TensorStorageMetadata):
            assert md_ours[key].size == entry.size and md_ours[key].properties.dtype == entry.properties.dtype, key
    assert (ours / "metadata.json").read_text() == (theirs / "metadata.json").read_text()
    assert torch.load(ours / "common.pt") == torch.load(theirs / "common.pt")

    r_ours, r_theirs = DistCheckpointReader(ours), DistCheckpointReader(theirs)
    names = [e.mcore for e in mapping.name_table(load_hf_config(hf))]
    assert any(len(md_theirs[k].chunks) > 2 for k in md_theirs if isinstance(md_theirs[k], TensorStorageMetadata))
    for name in names:
        assert torch.equal(r_ours.tensor(name), r_theirs.tensor(name)), name
