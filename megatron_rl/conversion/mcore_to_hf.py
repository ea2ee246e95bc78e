"""Convert a Megatron directory written by hf-to-mcore back into a Hugging Face checkpoint.

    megatron-rl convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--dtype bf16]
    python tools/convert_megatron_to_hf.py --mcore MCORE_DIR --out HF_DIR

    from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    convert_mcore_to_hf(mcore_dir, out_dir)

Everything is rebuilt from the Megatron directory alone: its manifest, the HF config and
tokenizer files kept in `hf/`, and the distributed checkpoint in `weights/` (loaded at TP1 PP1
whatever layout wrote it).  Tensors stream group by group through `mapping.mcore_to_hf_group`
into safetensors shards; vocabulary padding is removed.  The output dtype defaults to the
source checkpoint's, so HF -> Megatron -> HF is bit-identical when no precision was lost.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from megatron_rl.conversion import mapping
from megatron_rl.conversion.hf_io import HFWriter, atomic_output_dir, copy_model_side_files
from megatron_rl.conversion.hf_to_mcore import DTYPE_CHOICES, GroupProgress
from megatron_rl.conversion.model_io import HF_DIR, WEIGHTS_DIR, canonical_params, load_model, read_manifest, run_on_ranks

logger = logging.getLogger(__name__)

HF_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT_TO_HF = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _export_rank(rank: int, world_size: int, mcore_dir: str, out_tmp: str, out_dtype: str, max_shard_bytes: int) -> int:
    """Load the checkpoint at TP1 PP1 and stream every group into HF safetensors."""
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    root = Path(mcore_dir)
    manifest = read_manifest(root)
    cfg = load_hf_config(root / HF_DIR)
    dtype = HF_DTYPE_NAMES[out_dtype]
    with parallel_scope(tp=1, pp=1):
        model = build_gpt_model(cfg, platform=detect_platform("cpu", manifest["dtype"]), tp=1, pp=1,
                                perform_initialization=False)
        load_model(model, root / WEIGHTS_DIR)
        params = canonical_params(model)
        writer = HFWriter(out_tmp, max_shard_bytes=max_shard_bytes)
        progress = GroupProgress("mcore-to-hf")
        all_groups = mapping.groups(cfg)
        for i, group in enumerate(all_groups):
            mc = {n: p.detach() for n, p in params.items() if mapping.group_of(n) == group}
            for name, tensor in mapping.mcore_to_hf_group(cfg, group, mc):
                writer.add(name, tensor.to(dtype))
            progress(group, i + 1, len(all_groups))
        writer.close()
    return writer.total_bytes


def convert_mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False,
                        max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF model directory (config, tokenizer, safetensors) from a converted Megatron dir.

    dtype: None keeps the source HF checkpoint's dtype; else one of fp32 / bf16 / fp16.
    """
    from megatron_rl.models.hf_config import load_hf_config

    mcore_dir, out_dir = Path(mcore_dir), Path(out_dir)
    if out_dir.exists() and not force:
        raise FileExistsError(f"output directory {out_dir} already exists (use --force to replace it)")
    manifest = read_manifest(mcore_dir)
    cfg = load_hf_config(mcore_dir / HF_DIR)
    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)}")
    out_dtype = SHORT_TO_HF[dtype] if dtype else manifest.get("source_dtype", cfg.torch_dtype)
    if out_dtype not in HF_DTYPE_NAMES:
        raise ValueError(f"source dtype {out_dtype!r} in {mcore_dir} is not one of {sorted(HF_DTYPE_NAMES)}; pass --dtype")
    t0 = time.monotonic()
    with atomic_output_dir(out_dir, force=force) as tmp:
        (total,) = run_on_ranks(_export_rank, 1, str(mcore_dir), str(tmp), out_dtype, max_shard_bytes)
        copy_model_side_files(mcore_dir / HF_DIR, tmp)
        if out_dtype != cfg.torch_dtype:
            config = json.loads((tmp / "config.json").read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = out_dtype
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    logger.info("wrote %s (%.1f MB %s) in %.1fs", out_dir, total / 1e6, out_dtype, time.monotonic() - t0)
    return out_dir
