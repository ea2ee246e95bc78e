"""Unit tests of the Megatron <-> HF name/layout mapping (pure tensors, no processes).

    python -m pytest tests/unit/test_mapping.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megatron_rl.conversion import mapping

pytestmark = pytest.mark.unit


@dataclass
class Cfg:
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 3
    hidden_size: int = 12
    intermediate_size: int = 8
    vocab_size: int = 10
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = False
    moe: object = None


def random_hf(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in mapping.hf_shapes(cfg).items()}


def test_name_table_covers_hf_names_once():
    for cfg in (Cfg(), Cfg(qkv_bias=True, tie_word_embeddings=True), Cfg(qk_layernorm=True)):
        table = mapping.name_table(cfg)
        hf_names = [h for e in table for h in e.hf]
        assert len(hf_names) == len(set(hf_names))
        assert set(hf_names) == set(mapping.hf_shapes(cfg))
        assert ("lm_head.weight" in hf_names) == (not cfg.tie_word_embeddings)
        assert any(n.endswith("q_proj.bias") for n in hf_names) == cfg.qkv_bias
        assert sum(n.endswith(("q_norm.weight", "k_norm.weight")) for n in hf_names) == 4 * cfg.qk_layernorm
        assert len({e.mcore for e in table}) == len(table)


def test_qkv_layout_interleaves_per_group():
    cfg = Cfg(num_heads=4, num_kv_heads=2, head_dim=1, hidden_size=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0..3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    qkv = mapping.qkv_hf_to_mcore(cfg, q, k, v)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert qkv.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = mapping.qkv_mcore_to_hf(cfg, qkv)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_bias_roundtrip_and_bad_rows():
    cfg = Cfg(qkv_bias=True)
    q, k, v = torch.randn(12), torch.randn(6), torch.randn(6)
    qkv = mapping.qkv_hf_to_mcore(cfg, q, k, v)
    assert qkv.shape == (24,)
    assert all(torch.equal(a, b) for a, b in zip(mapping.qkv_mcore_to_hf(cfg, qkv), (q, k, v)))
    with pytest.raises(ValueError, match="linear_qkv has 23 rows"):
        mapping.qkv_mcore_to_hf(cfg, qkv[:23])


@pytest.mark.parametrize("tie,bias,qk_norm", [(False, False, False), (True, True, False), (False, False, True)])
def test_group_roundtrip_bit_identical(tie, bias, qk_norm):
    cfg = Cfg(tie_word_embeddings=tie, qkv_bias=bias, qk_layernorm=qk_norm)
    hf = random_hf(cfg)
    padded = 16
    shapes = mapping.mcore_shapes(cfg, padded)
    back = {}
    for group in mapping.groups(cfg):
        mc = mapping.hf_to_mcore_group(cfg, group, hf, padded)
        for name, t in mc.items():
            assert tuple(t.shape) == shapes[name], name
            assert mapping.group_of(name) == group
        back.update(mapping.mcore_to_hf_group(cfg, group, mc))
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    emb = mapping.hf_to_mcore_group(cfg, "embedding", hf, padded)[mapping.EMBED]
    assert emb.shape == (16, 12) and torch.count_nonzero(emb[10:]) == 0


def test_qwen3_qk_norm_maps_to_replicated_q_k_layernorm():
    """Qwen3's q_norm / k_norm ([head_dim], head_dim 5 != hidden/heads 3) are Megatron's q/k_layernorm, whole on every TP rank."""
    cfg = Cfg(qk_layernorm=True, head_dim=5)
    hf = random_hf(cfg)
    mc = mapping.hf_to_mcore_group(cfg, "layer.1", hf, 16)
    for hf_norm, mc_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        t = mc[f"decoder.layers.1.self_attention.{mc_norm}.weight"]
        assert torch.equal(t, hf[f"model.layers.1.self_attn.{hf_norm}.weight"]) and t.shape == (5,)
        assert mapping.tp_kind(f"decoder.layers.1.self_attention.{mc_norm}.weight") == "replicated"
    assert mc["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (2 * 4 * 5, 12)
    assert mc["decoder.layers.1.self_attention.linear_proj.weight"].shape == (12, 4 * 5)


def test_fc1_is_gate_then_up():
    cfg = Cfg()
    hf = random_hf(cfg)
    mc = mapping.hf_to_mcore_group(cfg, "layer.1", hf, 16)
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:8], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[8:], hf["model.layers.1.mlp.up_proj.weight"])


def test_bad_input_names_the_tensor():
    cfg = Cfg()
    hf = random_hf(cfg)
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 12)
    with pytest.raises(ValueError, match=r"up_proj.weight.*\(7, 12\)"):
        mapping.hf_to_mcore_group(cfg, "layer.0", hf, 16)
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        mapping.hf_to_mcore_group(cfg, "layer.0", hf, 16)
    with pytest.raises(ValueError, match="padded vocabulary"):
        mapping.hf_to_mcore_group(cfg, "embedding", random_hf(cfg), 8)
    with pytest.raises(KeyError):
        mapping.hf_to_mcore_group(cfg, "layer.9", random_hf(cfg), 16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        mapping.name_table(Cfg(num_heads=4, num_kv_heads=3))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shard_gather_roundtrip(tp):
    cfg = Cfg(num_heads=4, num_kv_heads=4, intermediate_size=8)
    hf = random_hf(cfg)
    for group in mapping.groups(cfg):
        for name, full in mapping.hf_to_mcore_group(cfg, group, hf, 16).items():
            shards = [mapping.tp_shard(name, full, tp, r) for r in range(tp)]
            assert torch.equal(mapping.tp_gather(name, shards), full), name
            if mapping.tp_kind(name) == "replicated":
                assert all(s is full for s in shards)
            else:
                assert sum(s.numel() for s in shards) == full.numel()


def test_tp_shard_layouts():
    full = torch.arange(8.0).reshape(8, 1)  # fc1: gate rows 0..3, up rows 4..7
    r1 = mapping.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", full, 2, 1)
    assert r1.flatten().tolist() == [2, 3, 6, 7]  # [gate_1; up_1]
    proj = torch.arange(8.0).reshape(2, 4)
    assert mapping.tp_shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 2, 1).tolist() == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match="TP=3"):
        mapping.tp_shard("output_layer.weight", torch.zeros(16, 2), 3, 0)


def test_local_and_canonical_names():
    local = "decoder.layers.1.input_layernorm.weight"
    canon = mapping.to_canonical_name(local, layer_offset=2)
    assert canon == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.to_local_spec_name(canon, layer_offset=2) == local
    assert mapping.to_canonical_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert mapping.to_canonical_name("embedding.word_embeddings.weight", 5) == "embedding.word_embeddings.weight"
    assert mapping.group_of("decoder.layers.12.mlp.linear_fc2.weight") == "layer.12"
    with pytest.raises(KeyError):
        mapping.group_of("foo.bar")


def _moe_cfg():
    from megatron_rl.models.hf_config import MoEConfig

    return Cfg(qk_layernorm=True, intermediate_size=0,
               moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=6, norm_topk_prob=True, router_aux_loss_coef=0.0))


def test_moe_table_maps_router_and_each_expert():
    cfg = _moe_cfg()
    table = mapping.name_table(cfg)
    by_mc = {e.mcore: e for e in table}
    assert set(h for e in table for h in e.hf) == set(mapping.hf_shapes(cfg))
    assert by_mc["decoder.layers.1.mlp.router.weight"].hf == ("model.layers.1.mlp.gate.weight",)
    fc1 = by_mc["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.kind == "fc1" and fc1.hf == ("model.layers.0.mlp.experts.3.gate_proj.weight",
                                            "model.layers.0.mlp.experts.3.up_proj.weight")
    assert not any(n.endswith(("mlp.gate_proj.weight", "mlp.linear_fc1.weight")) and "experts" not in n
                   for e in table for n in (e.mcore,) + e.hf)  # no dense MLP in a MoE layer
    assert mapping.mcore_shapes(cfg, 16)["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"] == (12, 6)
    hf = random_hf(cfg)
    for group in mapping.groups(cfg):
        back = dict(mapping.mcore_to_hf_group(cfg, group, mapping.hf_to_mcore_group(cfg, group, hf, 16)))
        assert all(torch.equal(back[k], hf[k]) for k in back) and back
    assert mapping.tp_kind("decoder.layers.0.mlp.router.weight") == "replicated"
    assert mapping.tp_kind("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight") == "fc1"
    assert mapping.tp_kind("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight") == "row"


def test_expert_names_carry_the_global_index():
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    canon = mapping.to_canonical_name(local, layer_offset=2, expert_offset=4)
    assert canon == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert mapping.to_local_spec_name(canon, layer_offset=2, expert_offset=4) == local
    assert mapping.to_canonical_name("decoder.layers.0.mlp.router.weight", expert_offset=4) == "decoder.layers.0.mlp.router.weight"


def test_expert_index_helpers():
    name = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert mapping.is_expert(name) and mapping.expert_index(name) == 5
    assert mapping.with_expert_index(name, 12) == "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight"
    router = "decoder.layers.1.mlp.router.weight"
    assert not mapping.is_expert(router)
    with pytest.raises(ValueError, match="router.weight"):
        mapping.with_expert_index(router, 0)


def test_layer_buffers_reuse_memory_across_layers_with_the_same_values():
    """The converter's LayerBuffers: each layer's QKV and per-expert [gate; up] land in the previous layer's
    memory (no fresh allocation per layer), with exactly the values the plain path computes."""
    cfg = _moe_cfg()
    hf = random_hf(cfg)
    buffers = mapping.LayerBuffers()
    pointers = []
    for group in ("layer.0", "layer.1"):
        plain = mapping.hf_to_mcore_group(cfg, group, hf, 16)
        reused = mapping.hf_to_mcore_group(cfg, group, hf, 16, buffers)
        assert sorted(plain) == sorted(reused)
        for name in plain:
            assert torch.equal(plain[name], reused[name]), name
        pointers.append({name.split(".", 3)[3]: t.data_ptr() for name, t in reused.items()
                         if name.endswith(("linear_qkv.weight", "linear_fc1.weight"))})
    assert len(pointers[0]) == 1 + cfg.moe.num_experts  # QKV and every expert's fc1 get their own buffer
    assert len(set(pointers[0].values())) == len(pointers[0])
    assert pointers[0] == pointers[1]  # layer 1 reuses layer 0's memory


def test_layer_buffers_reused_by_mcore_to_hf_for_q_k_v_with_the_same_values():
    """mcore -> HF with LayerBuffers: each layer's split q/k/v land in the previous layer's memory,
    with exactly the values the plain path yields."""
    cfg = _moe_cfg()
    hf = random_hf(cfg)
    buffers = mapping.LayerBuffers()
    pointers = []
    for group in ("layer.0", "layer.1"):
        mc = mapping.hf_to_mcore_group(cfg, group, hf, 16)
        plain = dict(mapping.mcore_to_hf_group(cfg, group, mc))
        reused = {}
        for name, t in mapping.mcore_to_hf_group(cfg, group, mc, buffers):
            reused[name] = t.clone()  # the next layer overwrites the buffers
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                pointers.append((name.split(".", 3)[3], t.data_ptr()))
        assert sorted(plain) == sorted(reused)
        for name in plain:
            assert torch.equal(plain[name], reused[name]), name
            assert torch.equal(plain[name], hf[name]), name
    assert len(pointers) == 6 and len({p for _, p in pointers[:3]}) == 3
    assert pointers[:3] == pointers[3:]  # layer 1's q/k/v reuse layer 0's memory
