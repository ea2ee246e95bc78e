"""A live Megatron GPTModel stage seen through canonical names; the Megatron dir's manifest.

    params = canonical_params(model)             # {"decoder.layers.5.mlp.linear_fc1.weight": Parameter}
    fill_from_hf(model, cfg, ckpt, tp_rank, tp)  # copy this rank's shard of every tensor
    load_model(model, mcore_dir / WEIGHTS_DIR)   # a converted checkpoint, at any TP/PP
    manifest = read_manifest(mcore_dir)          # FileNotFoundError when it is not ours

A converted Megatron directory holds:
  weights/        dist_checkpointing (torch_dist) checkpoint, loadable at any TP/PP (dist_ckpt.py)
  hf/             the source's config.json, generation_config.json and tokenizer files
  manifest.json   architecture, source hash, dtype, tokenizer hash, tool version, ...
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from megatron_rl.conversion import mapping
from megatron_rl.config import ConfigError
from megatron_rl.models.lora import base_parameters

logger = logging.getLogger(__name__)

WEIGHTS_DIR = "weights"
HF_DIR = "hf"
MANIFEST = "manifest.json"
FORMAT = "megatron-rl/mcore-dist-ckpt/v1"


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def canonical_params(model) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters under canonical names (global layer index, TE naming).

    Works for local and TE layer specs and DDP/Float16 wrappers.  A MoE model's experts get their
    global index (this rank's expert-parallel rank x experts per rank + local index).  With tied embeddings on a
    last stage that is not also the first, `output_layer.weight` is the tied copy and is
    returned under the embedding's name (it holds the same values).  LoRA adapter tensors
    (models/lora.py) are not the base model's and are left out.
    """
    model = _unwrap(model)
    local_to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    expert_offset = 0
    experts = getattr(model.config, "num_moe_experts", None)
    if experts:
        from megatron.core import parallel_state as ps

        expert_offset = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in base_parameters(model):  # a LoRA adapter beside a base layer is not the base's
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            name = f"decoder.layers.{local_to_global[int(m.group(1))]}.{m.group(2)}"
        canon = mapping.to_canonical_name(name, expert_offset=expert_offset)
        if canon == mapping.OUTPUT and tied:
            if mapping.EMBED in out:
                continue
            canon = mapping.EMBED
        out[canon] = param
    return out


def _stage_groups(cfg, params: dict) -> list[str]:
    return [g for g in mapping.groups(cfg) if any(mapping.group_of(n) == g for n in params)]


@torch.no_grad()
def fill_from_hf(model, cfg, ckpt, tp_rank: int, tp: int, padded_vocab: int, progress=None) -> int:
    """Copy this rank's TP shard of each HF tensor into `model` (one group in memory at a time).

    Returns the number of parameters filled; raises ValueError when a shape does not fit.
    """
    params = canonical_params(model)
    known = {e.mcore for e in mapping.name_table(cfg)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"model parameter {unknown[0]!r} has no HF source in the mapping")
    filled = 0
    stage_groups = _stage_groups(cfg, params)
    for i, group in enumerate(stage_groups):
        full = mapping.hf_to_mcore_group(cfg, group, ckpt.read_group(group), padded_vocab)
        for name, tensor in full.items():
            if name not in params:
                continue
            shard = mapping.tp_shard(name, tensor, tp, tp_rank)
            if shard.shape != params[name].shape:
                raise ValueError(f"{name}: TP shard {tuple(shard.shape)} does not fit the model's {tuple(params[name].shape)}")
            params[name].copy_(shard)
            filled += 1
        del full
        if progress is not None:
            progress(group, i + 1, len(stage_groups))
    if filled != len(params):
        raise ValueError(f"filled {filled} of the stage's {len(params)} parameters from the HF checkpoint")
    return filled


def load_model(model, weights_dir: Path) -> None:
    """Load a distributed checkpoint into `model` at its own TP/PP (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    weights_dir = Path(weights_dir)
    if not (weights_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{weights_dir} is not a Megatron-Core distributed checkpoint (no metadata.json)")
    inner = _unwrap(model)
    sharded = inner.sharded_state_dict()
    _tolerate_absent_final_norm_extra_state(sharded, weights_dir)
    state = dist_checkpointing.load(sharded, str(weights_dir), strict="raise_all")
    inner.load_state_dict(state, strict=False)


# On the TE platform the final norm is TE's (TENorm, platform.final_norm); TE modules carry an
# `_extra_state` (FP8 metadata) that local norms do not.  Checkpoints written without TE (the
# converter, CPU runs) lack it, and one written with it would be refused by a local model (strict
# load: unexpected key), so the converter does not write it and a load tolerates its absence: the
# module keeps its own (no-FP8: empty) state.
FINAL_NORM_EXTRA_STATE = "decoder.final_layernorm._extra_state"


def _tolerate_absent_final_norm_extra_state(sharded: dict, weights_dir: Path) -> None:
    if FINAL_NORM_EXTRA_STATE not in sharded:
        return
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(weights_dir)).read_metadata().state_dict_metadata
    if not any(k == FINAL_NORM_EXTRA_STATE or k.startswith(FINAL_NORM_EXTRA_STATE + "/") for k in keys):
        logger.info("%s: no %s in the checkpoint (written without Transformer Engine); the final "
                    "norm keeps its own extra state", weights_dir, FINAL_NORM_EXTRA_STATE)
        del sharded[FINAL_NORM_EXTRA_STATE]


def write_manifest(mcore_dir: Path, **fields) -> dict:
    manifest = {"format": FORMAT, **fields}
    (Path(mcore_dir) / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(mcore_dir: str | Path) -> dict:
    """The manifest of a converted Megatron directory; errors name what is missing."""
    root = Path(mcore_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"Megatron checkpoint directory not found: {root}")
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: not a checkpoint written by `megatron-rl convert hf-to-mcore`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for sub in (WEIGHTS_DIR, HF_DIR):
        if not (root / sub).is_dir():
            raise FileNotFoundError(f"{root}: missing {sub}/ next to {MANIFEST}")
    return manifest


def run_on_ranks(fn, world_size: int, *args) -> list:
    """fn(rank, world_size, *args) on `world_size` gloo ranks; in this process when it is 1.

    A single rank runs in-process (no spawn, no re-import) on a private one-rank gloo group,
    unless torch.distributed is already up here, in which case fresh processes are spawned.
    """
    import os

    import torch.distributed as dist

    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import init_distributed
    from megatron_rl.platform.spawn import loopback_store, run_distributed

    if world_size > 1 or dist.is_initialized():
        return run_distributed(fn, world_size, *args)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        init_distributed(detect_platform("cpu"), rank=0, world_size=1, store=loopback_store(1))
        try:
            return [fn(0, 1, *args)]
        finally:
            dist.destroy_process_group()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
