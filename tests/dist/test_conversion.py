"""HF -> Megatron (TP2 PP2) -> HF round trip and logits at several layouts, on gloo ranks.

    python -m pytest tests/dist/test_conversion.py -q

Per family (llama untied; qwen2 with q/k/v bias and tied embeddings): one 4-rank conversion,
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


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
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
