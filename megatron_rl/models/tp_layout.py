"""How each Megatron tensor is split across tensor-parallel ranks, by its canonical name.

    from megatron_rl.conversion.mapping import tp_shard, tp_gather    # re-exported there
    shard = tp_shard(name, full, tp=2, rank=1);  full = tp_gather(name, [shard0, shard1])

Part of the name and layout mapping (conversion/mapping.py, whose docstring gives the layouts):
column-parallel tensors split along dim 0, row-parallel along dim 1, `linear_fc1` ([gate; up])
splits each half so TP rank r holds [gate_r; up_r], everything else is replicated.  A LoRA adapter's
tensors (models/lora.py: `<linear>.adapter.lora_a` [r, in], `lora_b` [out, r]) split like the weight
they sit beside: B of a column-parallel layer by its rows, A of a row-parallel layer by its columns;
the other one of each pair is replicated.
"""

from __future__ import annotations

import torch

# TP layout by canonical-name suffix: column (dim 0), row (dim 1), fc1 (gate/up halves), replicated.
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight",
           "linear_qkv.adapter.lora_b")
_ROW = ("linear_proj.weight", "linear_fc2.weight", "linear_proj.adapter.lora_a", "linear_fc2.adapter.lora_a")
_FC1 = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc1.adapter.lora_b")


def tp_kind(mcore_name: str) -> str:
    """How a tensor is split across TP ranks: column | row | fc1 | replicated."""
    if mcore_name.endswith(_FC1):
        return "fc1"
    if mcore_name.endswith(_COLUMN):
        return "column"
    if mcore_name.endswith(_ROW):
        return "row"
    return "replicated"


def tp_shard(mcore_name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The slice of a full Megatron tensor that TP rank `rank` of `tp` holds."""
    kind = tp_kind(mcore_name)
    if kind == "replicated" or tp == 1:
        return full
    dim = 1 if kind == "row" else 0
    if full.shape[dim] % (2 * tp if kind == "fc1" else tp):
        raise ValueError(f"{mcore_name}: dim {dim} of size {full.shape[dim]} does not split over TP={tp}")
    if kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def tp_gather(mcore_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from the shards of TP ranks 0..tp-1, in order."""
    kind = tp_kind(mcore_name)
    if kind == "replicated" or len(shards) == 1:
        return shards[0]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if kind == "row" else 0)
