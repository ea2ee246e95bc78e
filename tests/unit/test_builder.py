"""The builder's Megatron model computes what transformers computes for Llama, Llama-3.x, Qwen2 and Qwen3.

    python -m pytest tests/unit/test_builder.py -q

A tiny HF model with random weights is built in the test; its weights are copied by hand (a
minimal local mapping, not the project's converter) into a TP1 Megatron model, and the logits
must agree within 1e-4.  That pins rope (plain and llama3-scaled), GQA grouping, qkv bias, RMSNorm,
Qwen3's q/k norm with a head_dim independent of hidden/heads, and tied embeddings.
The Megatron side runs in a spawned gloo process (run_distributed), keeping this process clean.
"""

import json

import pytest
import torch

from megatron_rl.models.hf_config import (
    HFModelConfig,
    check_parallel_layout,
    load_hf_config,
    padded_vocab_size,
)
from megatron_rl.platform.spawn import run_distributed

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


# original_max_position_embeddings 32 puts the 8 rotary frequencies of head_dim 16 (theta 5000) in
# all three llama3 bands: one kept, one interpolated, six divided by the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
HEAD_DIM = {"qwen3": 32}  # Qwen3: head_dim independent of hidden_size / num_heads (64 / 4 = 16)


def _hf_model(arch: str, tie: bool):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie, rope_theta=5000.0))
    elif arch == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie, rope_parameters=LLAMA3_ROPE))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tie, rope_theta=5000.0, head_dim=32))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie, rope_theta=5000.0))
    with torch.no_grad():  # random norms and biases, so a missing mapping cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.float().eval()


def _to_megatron(hf_sd: dict, cfg: HFModelConfig, vocab_padded: int) -> dict:
    """HF Llama/Qwen2 names -> Megatron GPTModel (local spec, TP1) names."""
    out = {}
    emb = torch.zeros(vocab_padded, cfg.hidden_size)
    emb[: cfg.vocab_size] = hf_sd["model.embed_tokens.weight"]
    out["embedding.word_embeddings.weight"] = emb
    per_group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = hf_sd[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = hf_sd[hf + "post_attention_layernorm.weight"]
        for suffix in (["weight", "bias"] if cfg.qkv_bias else ["weight"]):
            q = hf_sd[hf + f"self_attn.q_proj.{suffix}"].reshape(cfg.num_kv_heads, per_group * cfg.head_dim, -1)
            k = hf_sd[hf + f"self_attn.k_proj.{suffix}"].reshape(cfg.num_kv_heads, cfg.head_dim, -1)
            v = hf_sd[hf + f"self_attn.v_proj.{suffix}"].reshape(cfg.num_kv_heads, cfg.head_dim, -1)
            qkv = torch.cat([q, k, v], dim=1)  # per kv group: its q heads, then k, then v
            out[mg + f"self_attention.linear_qkv.{suffix}"] = qkv.reshape(-1, *qkv.shape[2:]).squeeze(-1)
        if cfg.qk_layernorm:
            out[mg + "self_attention.q_layernorm.weight"] = hf_sd[hf + "self_attn.q_norm.weight"]
            out[mg + "self_attention.k_layernorm.weight"] = hf_sd[hf + "self_attn.k_norm.weight"]
        out[mg + "self_attention.linear_proj.weight"] = hf_sd[hf + "self_attn.o_proj.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([hf_sd[hf + "mlp.gate_proj.weight"], hf_sd[hf + "mlp.up_proj.weight"]])
        out[mg + "mlp.linear_fc2.weight"] = hf_sd[hf + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        head = torch.zeros(vocab_padded, cfg.hidden_size)
        head[: cfg.vocab_size] = hf_sd["lm_head.weight"]
        out["output_layer.weight"] = head
    return out


def _megatron_logits(rank, world, cfg_dict, hf_sd, tokens):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(cfg_dict)
    with parallel_scope(tp=1, pp=1):
        model = build_gpt_model(cfg, platform=detect_platform("cpu"), tp=1, pp=1)
        sd = _to_megatron(hf_sd, cfg, padded_vocab_size(cfg.vocab_size, 1))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
        model.eval()
        with torch.no_grad():
            pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
            logits = model(tokens, pos, attention_mask=None)  # [B, T, V_padded]
        return logits[..., : cfg.vocab_size]


CASES = [("llama", False), ("llama", True), ("qwen2", False), ("llama3", False), ("qwen3", True), ("qwen3", False)]


def _megatron_logits_all(rank, world, jobs):
    return [_megatron_logits(rank, world, *job) for job in jobs]


@pytest.fixture(scope="module")
def parity_runs():
    """HF logits and Megatron logits for every case, computed in ONE spawned process."""
    jobs, expected = [], []
    tokens = torch.randint(0, TINY["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    for arch, tie in CASES:
        hf = _hf_model(arch, tie)
        with torch.no_grad():
            expected.append(hf(tokens).logits)  # [B, T, V]
        cfg_dict = hf.config.to_dict() | {"architectures": [type(hf).__name__]}
        jobs.append((cfg_dict, {k: v.detach().clone() for k, v in hf.state_dict().items()}, tokens))
    (got,) = run_distributed(_megatron_logits_all, 1, jobs, timeout=240)
    return dict(zip(CASES, zip(jobs, expected, got)))


@pytest.mark.parametrize("arch,tie", CASES)
def test_megatron_logits_match_transformers(parity_runs, arch, tie):
    (cfg_dict, _, _), expected, got = parity_runs[(arch, tie)]
    cfg = load_hf_config(cfg_dict)
    assert cfg.arch == {"llama3": "llama"}.get(arch, arch)
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.tie_word_embeddings == tie and cfg.qk_layernorm == (arch == "qwen3")
    assert cfg.rope_theta == 5000.0 and cfg.num_kv_heads == 2 and cfg.head_dim == HEAD_DIM.get(arch, 16)
    assert (cfg.rope_scaling is not None) == (arch == "llama3")
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _write(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data) if isinstance(data, dict) else data)
    return tmp_path


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6}


def test_load_hf_config_from_dir_and_file(tmp_path):
    _write(tmp_path, LLAMA)
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        cfg = load_hf_config(source)
        assert (cfg.arch, cfg.head_dim, cfg.rope_theta, cfg.qkv_bias) == ("llama", 16, 1e6, False)


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


def test_load_hf_config_reads_qwen3_moe_and_checks_ep(tmp_path):
    """Qwen3-MoE's expert fields (either experts spelling) and the EP layout checks."""
    from megatron_rl.models.builder import moe_config_fields

    cfg = load_hf_config(_write(tmp_path, LLAMA | {"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8,
                                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    assert cfg.arch == "qwen3_moe" and cfg.qk_layernorm and cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    assert not cfg.moe.norm_topk_prob  # HF's default
    fields = moe_config_fields(cfg, ep=2)
    assert fields["moe_router_pre_softmax"] is True and fields["expert_model_parallel_size"] == 2
    assert moe_config_fields(load_hf_config(_write(tmp_path, LLAMA | {"architectures": ["Qwen3MoeForCausalLM"]} | MOE))
                             )["moe_router_pre_softmax"] is False
    check_parallel_layout(cfg, 1, 1, dp=2, ep=2)
    with pytest.raises(ValueError, match="num_experts 8 is not divisible by expert parallel size 3"):
        check_parallel_layout(cfg, 1, 1, dp=3, ep=3)
    with pytest.raises(ValueError, match="data parallel size 1 is not a multiple of expert parallel size 2"):
        check_parallel_layout(cfg, 1, 1, dp=1, ep=2)
    with pytest.raises(ValueError, match="needs a MoE model"):
        check_parallel_layout(load_hf_config(_write(tmp_path, LLAMA)), 1, 1, dp=2, ep=2)


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"rope_parameters": LLAMA3_ROPE | {"factor": 0}}, "rope_scaling.factor"),
    ({"rope_parameters": LLAMA3_ROPE | {"high_freq_factor": 0.5}}, "high_freq_factor 0.5"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=true is not supported for qwen3"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "missing field 'num_experts'"),
    ({"architectures": ["Qwen3MoeForCausalLM"]} | MOE | {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"architectures": ["Qwen3MoeForCausalLM"]} | MOE | {"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ({"architectures": ["Qwen3MoeForCausalLM"]} | MOE | {"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds"),
    ({"architectures": ["Qwen3MoeForCausalLM"]} | MOE | {"shared_expert_intermediate_size": 64}, "shared_expert"),
    ({"architectures": ["Qwen3MoeForCausalLM"]} | MOE | {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_size": "64"}, "hidden_size"),
])
def test_load_hf_config_refuses_what_we_do_not_implement(tmp_path, change, match):
    """Bad or unimplemented fields are refused by name (MoE: dense layers mixed in, shared experts)."""
    with pytest.raises(ValueError, match=match):
        load_hf_config(_write(tmp_path, LLAMA | change))


def test_load_hf_config_reads_llama3_rope_both_spellings():
    old = load_hf_config(LLAMA | {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}})
    new = load_hf_config(LLAMA | {"rope_parameters": LLAMA3_ROPE})
    assert old.rope_scaling == new.rope_scaling and old.rope_scaling.original_max_position_embeddings == 32
    assert (old.rope_theta, new.rope_theta) == (1e6, 5000.0)
    assert load_hf_config(LLAMA).rope_scaling is None


def test_load_hf_config_missing_or_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(_write(tmp_path, "{not json"))


def test_padded_vocab_size():
    assert padded_vocab_size(100, 1) == 128
    assert padded_vocab_size(128, 1) == 128
    assert padded_vocab_size(129, 2) == 256
    assert padded_vocab_size(151936, 4) == 152064
    assert padded_vocab_size(257, 2) % 256 == 0
    with pytest.raises(ValueError):
        padded_vocab_size(0, 1)


def test_check_parallel_layout_names_the_number():
    cfg = load_hf_config(LLAMA)
    check_parallel_layout(cfg, tp=2, pp=4)
    with pytest.raises(ValueError, match="num_heads 4 .* 8"):
        check_parallel_layout(cfg, tp=8, pp=1)
    with pytest.raises(ValueError, match="num_kv_heads 2 .* 4"):
        check_parallel_layout(load_hf_config(LLAMA | {"num_attention_heads": 8}), tp=4, pp=1)
    with pytest.raises(ValueError, match="num_layers 4 .* 3"):
        check_parallel_layout(cfg, tp=1, pp=3)
    with pytest.raises(ValueError, match="tp"):
        check_parallel_layout(cfg, tp=0, pp=1)
