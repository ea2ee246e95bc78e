"""On a GPU: the Transformer Engine layer spec computes what the local spec computes (bf16).

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu -m gpu -q

A tiny Llama is built twice at TP1 in bf16 — local spec and TE spec — with the same weights
(TE fuses the pre-attention / pre-MLP RMSNorm into linear_qkv / linear_fc1, so those two
names move).  Both must agree with each other to bf16 precision and with an fp32 local-spec
reference better than an unrelated model would.  Skipped without CUDA or Transformer Engine.
"""

import importlib.util

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs transformer_engine"),
]

TINY = {"model_type": "llama", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}


def _local_to_te(name: str) -> str:
    name = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
    return name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")


def _logits(rank, world):
    import dataclasses

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(TINY)
    te = detect_platform("cuda", "bf16")
    assert te.use_te and te.backend == "nccl"
    local = dataclasses.replace(te, use_te=False)
    fp32 = dataclasses.replace(te, use_te=False, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(64, device="cuda").expand_as(tokens)
    out = {}
    with parallel_scope(tp=1, pp=1, seed=11):
        ref_model = build_gpt_model(cfg, platform=fp32, tp=1, pp=1).eval()
        weights = {k: v for k, v in ref_model.state_dict().items() if not k.endswith("_extra_state")}
        for name, platform in (("fp32", fp32), ("local", local), ("te", te)):
            model = ref_model if name == "fp32" else build_gpt_model(cfg, platform=platform, tp=1, pp=1).eval()
            if name != "fp32":
                mapped = {(_local_to_te(k) if name == "te" else k): v.to(platform.dtype) for k, v in weights.items()}
                missing, unexpected = model.load_state_dict(mapped, strict=False)
                assert not unexpected and not [m for m in missing if not m.endswith("_extra_state")], missing
            with torch.no_grad():
                out[name] = model(tokens, pos, attention_mask=None)[..., : cfg.vocab_size].float().cpu()
    return out


def test_te_spec_matches_local_spec_in_bf16():
    (out,) = run_distributed(_logits, 1, device="cuda", timeout=600)
    scale = out["fp32"].abs().max().item()
    te_vs_local = (out["te"] - out["local"]).abs().max().item()
    local_vs_fp32 = (out["local"] - out["fp32"]).abs().max().item()
    te_vs_fp32 = (out["te"] - out["fp32"]).abs().max().item()
    assert te_vs_local < 0.05 * scale, (te_vs_local, scale)
    # bf16 error of TE no worse than twice the local spec's own bf16 error
    assert te_vs_fp32 < 2 * local_vs_fp32 + 1e-3 * scale, (te_vs_fp32, local_vs_fp32)
