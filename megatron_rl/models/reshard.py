"""Cut a full (TP1, PP1) Megatron GPTModel state dict into one rank's TP/PP shard.

    local_sd = shard_state_dict(full_sd, tp=2, tp_rank=1, pp=2, pp_rank=0, num_layers=4,
                                tie_word_embeddings=False)
    model.load_state_dict(local_sd, strict=False)

Used by the parallel-equivalence tests and to start every layout from the same weights.  It
knows Megatron's local/TE GPT layer names (this is Megatron<->Megatron resharding; HF<->Megatron
mapping lives in megatron_rl.conversion):
  column-parallel, split on dim 0: word embeddings, output layer, linear_qkv (group-major, so
      contiguous blocks are whole KV groups), linear_fc1 (gate and up halves split separately)
  row-parallel, split on dim 1: linear_proj, linear_fc2
  replicated: norms
(the split itself is models/tp_layout.py's, which also refuses a dimension TP does not divide)
Pipeline stage s holds layers [s*L/pp, (s+1)*L/pp), renumbered from 0; the embedding lives on
the first stage, the final norm and output layer on the last (a copy of the embedding when the
embeddings are tied and pp > 1, as Megatron keeps it).
"""

from __future__ import annotations

import re

import torch

from megatron_rl.models.tp_layout import tp_shard

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def _repad_vocab(tensor: torch.Tensor, vocab_size: int, tp: int) -> torch.Tensor:
    """Rows [0, vocab_size) kept, padding re-made (zeros) for the target TP's padded vocab."""
    from megatron_rl.models.hf_config import padded_vocab_size

    out = tensor.new_zeros(padded_vocab_size(vocab_size, tp), *tensor.shape[1:])
    out[:vocab_size] = tensor[:vocab_size]
    return out


def shard_state_dict(full: dict, *, tp: int, tp_rank: int, pp: int, pp_rank: int, num_layers: int,
                     tie_word_embeddings: bool, vocab_size: int | None = None) -> dict:
    """One rank's shard of a full GPTModel state dict (see the module docstring).

    vocab_size: the real vocabulary; when given, the embedding/output rows are re-padded for
    `tp` (Megatron pads to a multiple of 128*tp, so TP1 and TP2 tables differ in length).
    """
    if vocab_size is not None:
        full = {k: (_repad_vocab(v, vocab_size, tp) if k.endswith(("word_embeddings.weight", "output_layer.weight"))
                    else v) for k, v in full.items()}
    if num_layers % pp:
        raise ValueError(f"num_layers {num_layers} is not divisible by pp {pp}")
    per_stage = num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name, tensor in full.items():
        if name.endswith("_extra_state"):
            continue
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if not pp_rank * per_stage <= index < (pp_rank + 1) * per_stage:
                continue
            name = f"decoder.layers.{index - pp_rank * per_stage}.{match.group(2)}"
        elif name.startswith("embedding.") and not first:
            continue
        elif (name.startswith("decoder.final_layernorm") or name.startswith("output_layer.")) and not last:
            continue
        out[name] = tp_shard(name, tensor, tp, tp_rank).clone()
    if tie_word_embeddings and last and pp > 1:
        out["output_layer.weight"] = tp_shard("output_layer.weight", full["embedding.word_embeddings.weight"],
                                               tp, tp_rank).clone()
    return out


def load_shard(model: torch.nn.Module, full: dict, *, tp: int, tp_rank: int, pp: int, pp_rank: int,
               num_layers: int, tie_word_embeddings: bool, vocab_size: int | None = None) -> None:
    """Load this rank's shard of `full` into `model`; ValueError naming any key that does not fit."""
    local = shard_state_dict(full, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, num_layers=num_layers,
                             tie_word_embeddings=tie_word_embeddings, vocab_size=vocab_size)
    missing, unexpected = model.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"shard does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
