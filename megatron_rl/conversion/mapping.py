"""The one Megatron-Core <-> Hugging Face name and layout mapping (Llama, Qwen2, Qwen3, Qwen3-MoE).

    from megatron_rl.conversion import mapping
    table = mapping.name_table(cfg)                    # every tensor, both names, one group each
    mc = mapping.hf_to_mcore_group(cfg, group, hf_tensors, padded_vocab)    # one layer group
    for hf_name, t in mapping.mcore_to_hf_group(cfg, group, mc_tensors): ...

Used by the checkpoint converter and by the weight publisher (which streams TP-gathered layer
groups of a live Megatron model through `mcore_to_hf_group`).  Pure tensor code: no
torch.distributed, no model objects.  `cfg` is anything with the `HFModelConfig` fields
(num_layers, num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size, vocab_size,
tie_word_embeddings, qkv_bias, and optionally qk_layernorm and moe).

Megatron names here are *canonical*: global layer index and Transformer Engine naming, which
is also what Megatron's distributed checkpoints use (the local layer spec renames
`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_` and `pre_mlp_layernorm.` ->
`mlp.linear_fc1.layer_norm_` through its `sharded_state_dict_keys_map`).  `to_local_spec_name`
and `to_canonical_name` switch between a local-spec module's parameter names and these.

Layouts (shape legend: H hidden, F ffn, hd head dim, nq query heads, ng KV groups,
qpg = nq // ng query heads per group, V vocab, Vp padded vocab):
  linear_qkv.weight  [ng * (qpg + 2) * hd, H]  per group g: q heads of g, then k_g, then v_g
  linear_qkv.bias    [ng * (qpg + 2) * hd]     same interleave (Qwen2)
  q_layernorm / k_layernorm.weight  [hd]       Qwen3's q_norm / k_norm, replicated over TP
  linear_fc1.weight  [2F, H]                   [gate; up]; TP rank r holds [gate_r; up_r]
  word_embeddings / output_layer  [Vp, H]      rows >= V are padding (zeros on import)

Qwen3-MoE layers (E experts of width Fe) replace the dense MLP tensors with:
  mlp.router.weight  [E, H]                    HF mlp.gate.weight, replicated over TP
  mlp.experts.local_experts.{e}.linear_fc1.weight  [2Fe, H]   HF mlp.experts.{e}.gate_proj / up_proj
  mlp.experts.local_experts.{e}.linear_fc2.weight  [H, Fe]    HF mlp.experts.{e}.down_proj
Canonical expert names carry the *global* expert index e; a model built at expert parallel EP holds
experts [r * E/EP, (r+1) * E/EP) on EP rank r under local indices 0.. (`canonical_params` maps them).
Expert weights are TP-split like the dense MLP (expert TP = TP).  The pre-MLP RMSNorm keeps the dense
canonical name (`mlp.linear_fc1.layer_norm_weight`), which is what the local spec's MoE layer writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from megatron_rl.models.tp_layout import tp_gather, tp_kind, tp_shard

__all__ = [
    "SUPPORTED_ARCHS",
    "NameEntry",
    "name_table",
    "groups",
    "group_of",
    "hf_shapes",
    "mcore_shapes",
    "LayerBuffers",
    "hf_to_mcore_group",
    "mcore_to_hf_group",
    "qkv_hf_to_mcore",
    "qkv_mcore_to_hf",
    "tp_shard",
    "tp_gather",
    "tp_kind",
    "to_canonical_name",
    "to_local_spec_name",
]

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

# Per layer: canonical Megatron suffix -> (HF suffixes, kind).  Kinds: copy, qkv, fc1.
_LAYER_TABLE = (
    ("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",), "copy"),
    ("self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    ("self_attention.linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "copy"),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "copy"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy"),
    ("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",), "copy"),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy"),
)

_QK_NORM = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
# A MoE layer's MLP: router, then per expert (canonical suffix, HF suffixes, kind) with {e} the global index.
ROUTER = ("mlp.router.weight", ("mlp.gate.weight",), "copy")
_EXPERT_TABLE = (
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), "fc1"),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), "copy"),
)
_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")

# Local layer spec parameter names <-> canonical (TE / dist-checkpoint) names.
_LOCAL_TO_CANON = (
    (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
)



@dataclass(frozen=True)
class NameEntry:
    """One Megatron tensor and the HF tensors it is made of."""

    mcore: str
    """Canonical Megatron name (global layer index, TE naming)."""
    hf: tuple[str, ...]
    """HF names, in the order the layout transform takes them (q, k, v / gate, up / one)."""
    kind: str
    """copy | qkv | fc1 | vocab (padded rows)."""
    group: str
    """Streaming unit: "embedding", "layer.{i}", "final" (final norm + output layer)."""


def _check_cfg(cfg) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")


def _qk_norm(cfg) -> bool:
    return bool(getattr(cfg, "qk_layernorm", False))


def _moe(cfg):
    return getattr(cfg, "moe", None)


def _layer_entries(cfg) -> list[tuple[str, tuple[str, ...], str]]:
    """(canonical suffix, HF suffixes, kind) of one transformer layer of `cfg`, in streaming order."""
    rows = []
    for mc, hf, kind in _LAYER_TABLE:
        if mc.endswith(".bias") and not cfg.qkv_bias:
            continue
        if mc in _QK_NORM and not _qk_norm(cfg):
            continue
        if mc in _DENSE_MLP and _moe(cfg) is not None:
            continue
        rows.append((mc, hf, kind))
    if _moe(cfg) is not None:
        rows.append(ROUTER)
        for e in range(cfg.moe.num_experts):
            rows.extend((mc.format(e=e), tuple(h.format(e=e) for h in hf), kind) for mc, hf, kind in _EXPERT_TABLE)
    return rows


def name_table(cfg) -> list[NameEntry]:
    """Every tensor of the model: Megatron name, HF names, layout kind, streaming group."""
    _check_cfg(cfg)
    table = [NameEntry(EMBED, ("model.embed_tokens.weight",), "vocab", "embedding")]
    layer = _layer_entries(cfg)
    for i in range(cfg.num_layers):
        for mc, hf, kind in layer:
            table.append(NameEntry(f"decoder.layers.{i}.{mc}", tuple(f"model.layers.{i}.{h}" for h in hf), kind, f"layer.{i}"))
    table.append(NameEntry(FINAL_NORM, ("model.norm.weight",), "copy", "final"))
    if not cfg.tie_word_embeddings:
        table.append(NameEntry(OUTPUT, ("lm_head.weight",), "vocab", "final"))
    return table


def groups(cfg) -> list[str]:
    """Streaming groups in model order: embedding, layer.0 .. layer.{L-1}, final."""
    return ["embedding"] + [f"layer.{i}" for i in range(cfg.num_layers)] + ["final"]


def group_of(mcore_name: str) -> str:
    """The streaming group a canonical Megatron name belongs to."""
    m = re.match(r"decoder\.layers\.(\d+)\.", mcore_name)
    if m:
        return f"layer.{m.group(1)}"
    if mcore_name == EMBED:
        return "embedding"
    if mcore_name in (FINAL_NORM, OUTPUT):
        return "final"
    raise KeyError(f"{mcore_name!r} is not a Megatron GPT tensor name this mapping knows")


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor for `cfg` (for validating a checkpoint before use)."""
    H, F, hd, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "self_attn.o_proj.weight": (H, q),
        "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
    }
    if _moe(cfg) is not None:
        E, Fe = cfg.moe.num_experts, cfg.moe.ffn_hidden_size
        per_layer["mlp.gate.weight"] = (E, H)
        for e in range(E):
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (Fe, H), f"mlp.experts.{e}.up_proj.weight": (Fe, H),
                              f"mlp.experts.{e}.down_proj.weight": (H, Fe)})
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(cfg.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    wanted = {h for e in name_table(cfg) for h in e.hf}
    return {k: v for k, v in shapes.items() if k in wanted}


def mcore_shapes(cfg, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Full (TP-gathered) shape of every canonical Megatron tensor."""
    hf = hf_shapes(cfg)
    out = {}
    for e in name_table(cfg):
        first = hf[e.hf[0]]
        if e.kind == "vocab":
            out[e.mcore] = (padded_vocab,) + first[1:]
        else:  # concatenation along dim 0 for qkv / fc1, identity for copy
            out[e.mcore] = (sum(hf[h][0] for h in e.hf),) + first[1:]
    return out


# ---------------------------------------------------------------------------- layouts


def qkv_hf_to_mcore(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """HF q [nq*hd, *r], k/v [ng*hd, *r] -> Megatron linear_qkv [ng*(qpg+2)*hd, *r] (into `out` if given)."""
    ng, hd = cfg.num_kv_heads, cfg.head_dim
    qpg = cfg.num_heads // ng
    rest = q.shape[1:]
    q_g = q.reshape(ng, qpg * hd, *rest)  # [ng, qpg*hd, *r]
    k_g = k.reshape(ng, hd, *rest)  # [ng, hd, *r]
    v_g = v.reshape(ng, hd, *rest)
    if out is None:
        return torch.cat([q_g, k_g, v_g], dim=1).reshape(ng * (qpg + 2) * hd, *rest)
    torch.cat([q_g, k_g, v_g], dim=1, out=out.view(ng, (qpg + 2) * hd, *rest))
    return out


def qkv_mcore_to_hf(cfg, qkv: torch.Tensor, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron linear_qkv [ng*(qpg+2)*hd, *r] -> HF (q [nq*hd, *r], k [ng*hd, *r], v [ng*hd, *r]) (into `out`)."""
    ng, hd = cfg.num_kv_heads, cfg.head_dim
    qpg = cfg.num_heads // ng
    rest = qkv.shape[1:]
    expected = ng * (qpg + 2) * hd
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, expected {expected} for {ng} groups x {qpg + 2} heads x {hd}")
    g = qkv.reshape(ng, (qpg + 2) * hd, *rest)
    parts = torch.split(g, [qpg * hd, hd, hd], dim=1)  # [ng, rows per group, *r] views
    if out is None:
        return tuple(p.reshape(ng * p.shape[1], *rest).contiguous() for p in parts)
    for p, o in zip(parts, out):
        o.view(p.shape).copy_(p)
    return tuple(out)


def _pad_rows(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"{name}: {t.shape[0]} rows do not fit the padded vocabulary of {rows}")
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


class LayerBuffers:
    """Output tensors for `hf_to_mcore_group` that are reused from one layer group to the next.

    A converter that writes each group's tensors out before asking for the next group's passes one
    of these: the concatenated tensors (QKV, [gate; up] -- per expert in a MoE model) then land in
    memory already touched by the previous layer instead of fresh allocations, whose first-touch
    page faults cost about as much as the copy itself.  The tensors of the previous group are
    overwritten: keep none of them.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, mcore_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (re.sub(r"^(decoder|model)\.layers\.\d+\.", "", mcore_name), tuple(shape), dtype)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(shape, dtype=dtype)
        return buf


def hf_to_mcore_group(cfg, group: str, hf: Mapping[str, torch.Tensor], padded_vocab: int,
                      buffers: LayerBuffers | None = None) -> dict[str, torch.Tensor]:
    """One group's HF tensors (HF names) -> full Megatron tensors (canonical names).

    With `buffers`, concatenated tensors are written into its reused tensors (see LayerBuffers).
    Raises KeyError naming a missing HF tensor and ValueError naming a wrong shape.
    """
    shapes = hf_shapes(cfg)
    out = {}
    for e in name_table(cfg):
        if e.group != group:
            continue
        parts = []
        for h in e.hf:
            if h not in hf:
                raise KeyError(f"HF tensor {h!r} is missing (needed for {e.mcore})")
            if tuple(hf[h].shape) != shapes[h]:
                raise ValueError(f"HF tensor {h!r} has shape {tuple(hf[h].shape)}, config says {shapes[h]}")
            parts.append(hf[h])
        if e.kind in ("qkv", "fc1"):
            rows = sum(p.shape[0] for p in parts)
            dst = None if buffers is None else buffers.get(e.mcore, (rows, *parts[0].shape[1:]), parts[0].dtype)
            if e.kind == "qkv":
                out[e.mcore] = qkv_hf_to_mcore(cfg, *parts, out=dst)
            else:
                out[e.mcore] = torch.cat(parts, dim=0, out=dst)  # [2F, H] = [gate; up]
        elif e.kind == "vocab":
            out[e.mcore] = _pad_rows(parts[0], padded_vocab, e.hf[0])
        else:
            out[e.mcore] = parts[0]
    if not out:
        raise KeyError(f"unknown group {group!r}; groups are {groups(cfg)[:3]} ... 'final'")
    return out


def mcore_to_hf_group(cfg, group: str, mc: Mapping[str, torch.Tensor],
                      buffers: LayerBuffers | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One group's full Megatron tensors (canonical names) -> (HF name, tensor) pairs.

    With `buffers`, the split q/k/v land in its reused tensors: use each before the next group.
    Vocabulary padding is dropped.  Raises KeyError naming a missing Megatron tensor.
    """
    found = False
    for e in name_table(cfg):
        if e.group != group:
            continue
        found = True
        if e.mcore not in mc:
            raise KeyError(f"Megatron tensor {e.mcore!r} is missing (group {group})")
        t = mc[e.mcore]
        if e.kind == "qkv":
            rows = (cfg.num_heads * cfg.head_dim,) + (cfg.num_kv_heads * cfg.head_dim,) * 2
            dst = None if buffers is None else [buffers.get(h, (n, *t.shape[1:]), t.dtype) for h, n in zip(e.hf, rows)]
            yield from zip(e.hf, qkv_mcore_to_hf(cfg, t, out=dst))
        elif e.kind == "fc1":
            gate, up = torch.chunk(t, 2, dim=0)
            yield e.hf[0], gate.contiguous()
            yield e.hf[1], up.contiguous()
        elif e.kind == "vocab":
            yield e.hf[0], t[: cfg.vocab_size].contiguous()
        else:
            yield e.hf[0], t
    if not found:
        raise KeyError(f"unknown group {group!r}")


# ---------------------------------------------------------------------------- tensor parallel


# ---------------------------------------------------------------------------- naming


def to_canonical_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """A model parameter name (local or TE spec, stage-local layer index, EP-local expert index) -> canonical name."""
    for local, canon in _LOCAL_TO_CANON:
        name = name.replace(local, canon)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}.", name)
    if layer_offset:
        name = re.sub(r"^(.*decoder\.layers\.)(\d+)\.", lambda m: f"{m.group(1)}{int(m.group(2)) + layer_offset}.", name)
    return name


def is_expert(mcore_name: str) -> bool:
    """Whether a canonical name is one expert's weight (not the router)."""
    return _LOCAL_EXPERT.search(mcore_name) is not None


def expert_index(mcore_name: str) -> int:
    """The expert index in an expert weight's name (ValueError for any other name)."""
    m = _LOCAL_EXPERT.search(mcore_name)
    if m is None:
        raise ValueError(f"{mcore_name!r} is not an expert weight")
    return int(m.group(2))


def with_expert_index(mcore_name: str, index: int) -> str:
    """An expert weight's name with its expert index replaced by `index`."""
    expert_index(mcore_name)
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{index}.", mcore_name, count=1)


def to_local_spec_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """A canonical name -> the parameter name in a local-spec model (stage-local layer index, EP-local expert)."""
    for local, canon in _LOCAL_TO_CANON:
        name = name.replace(canon, local)
    if expert_offset:
        name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) - expert_offset}.", name)
    if layer_offset:
        name = re.sub(r"^(.*decoder\.layers\.)(\d+)\.", lambda m: f"{m.group(1)}{int(m.group(2)) - layer_offset}.", name)
    return name
