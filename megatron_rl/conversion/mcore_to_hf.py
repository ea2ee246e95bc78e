"""Convert a Megatron directory written by hf-to-mcore back into a Hugging Face checkpoint.

    megatron-rl convert mcore-to-hf --mcore MCORE_DIR --out HF_DIR [--dtype bf16]
    megatron-rl convert mcore-to-hf --mcore RUN_DIR/checkpoints/step_000060 --out HF_DIR   # a trained policy
    python tools/convert.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR

    from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf
    convert_mcore_to_hf(mcore_dir, out_dir)

Everything is rebuilt from the Megatron directory alone: its manifest, the HF config and
tokenizer files kept in `hf/`, and the distributed checkpoint in `weights/` (read tensor by
tensor, whatever TP/PP wrote it; no model is built).  Tensors stream group by group through
`mapping.mcore_to_hf_group` straight into safetensors shards; vocabulary padding is removed.  The output dtype defaults to the
source checkpoint's, so HF -> Megatron -> HF is bit-identical when no precision was lost.

A training checkpoint (a committed `RUN_DIR/checkpoints/step_N`) exports the same way: its files
are verified against its COMMITTED manifest, the HF config and tokenizer come from the model the
run started from (megatron_rl/run_model.py run_model_dir: the directory RUN_DIR/run_manifest.json
records, else the one RUN_DIR/config.json leads to; its tokenizer must hash to the checkpoint's),
and only the policy's weights are read from `weights/` (the optimizer state stays behind).  A LoRA
run's checkpoint holds adapters only: it exports as its base with the adapters merged in (lora_io.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from megatron_rl.conversion import mapping
from megatron_rl.conversion.dist_ckpt import DistCheckpointReader
from megatron_rl.conversion.hf_io import HFWriter, atomic_output_dir, check_output_dir, copy_model_side_files
from megatron_rl.conversion.hf_to_mcore import DTYPE_CHOICES, TORCH_DTYPES, GroupProgress
from megatron_rl.checkpoint import MANIFEST as COMMITTED
from megatron_rl.conversion.model_io import HF_DIR, WEIGHTS_DIR, read_manifest
from megatron_rl.config import ConfigError
from megatron_rl.run_model import training_checkpoint_model_dir  # noqa: F401  (its home before run_model.py)

logger = logging.getLogger(__name__)

SHORT_TO_HF = {short: str(dtype).removeprefix("torch.") for short, dtype in TORCH_DTYPES.items()}  # fp32 -> float32
HF_DTYPE_NAMES = {SHORT_TO_HF[short]: dtype for short, dtype in TORCH_DTYPES.items()}  # float32 -> torch.float32


def _export_weights(weights_dir: Path, cfg, out_dir: Path, dtype: torch.dtype, max_shard_bytes: int) -> int:
    """Stream every layer group from the checkpoint into HF safetensors shards. Returns bytes written."""
    reader = DistCheckpointReader(weights_dir)
    table = mapping.name_table(cfg)
    shapes = mapping.hf_shapes(cfg)
    writer = HFWriter(out_dir, {h: (shapes[h], dtype) for e in table for h in e.hf}, max_shard_bytes=max_shard_bytes)
    progress = GroupProgress("mcore-to-hf")
    all_groups = mapping.groups(cfg)
    buffers = mapping.LayerBuffers()  # reads and q/k/v reuse one layer's memory (each is written out at once)
    try:
        for i, group in enumerate(all_groups):
            mc = {e.mcore: reader.tensor(e.mcore, buffers.get) for e in table if e.group == group}
            for name, tensor in mapping.mcore_to_hf_group(cfg, group, mc, buffers):
                writer.add(name, tensor.to(dtype))
            progress(group, i + 1, len(all_groups))
        writer.close()
    finally:
        reader.close()
    return writer.total_bytes


def convert_mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, force: bool = False,
                        max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF model directory (config, tokenizer, safetensors) from a converted Megatron dir.

    dtype: None keeps the source HF checkpoint's dtype; else one of fp32 / bf16 / fp16.
    """
    from megatron_rl.models.hf_config import load_hf_config

    mcore_dir, out_dir = Path(mcore_dir), Path(out_dir)
    check_output_dir(out_dir, force)
    if (mcore_dir / COMMITTED).is_file() and (mcore_dir / WEIGHTS_DIR / "lora.json").is_file():
        from megatron_rl.conversion.lora_io import export_lora_checkpoint  # adapters only: merge into the base

        return export_lora_checkpoint(mcore_dir, merged=out_dir, dtype=TORCH_DTYPES[dtype] if dtype else None,
                                      force=force)[0]
    if (mcore_dir / COMMITTED).is_file():
        hf_dir = training_checkpoint_model_dir(mcore_dir)
        manifest = {}
    else:
        hf_dir = mcore_dir / HF_DIR
        manifest = read_manifest(mcore_dir)
    cfg = load_hf_config(hf_dir)
    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise ConfigError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)}")
    out_dtype = SHORT_TO_HF[dtype] if dtype else manifest.get("source_dtype", cfg.torch_dtype)
    if out_dtype not in HF_DTYPE_NAMES:
        raise ConfigError(f"source dtype {out_dtype!r} in {mcore_dir} is not one of {sorted(HF_DTYPE_NAMES)}; pass --dtype")
    t0 = time.monotonic()
    with atomic_output_dir(out_dir, force=force) as tmp:
        total = _export_weights(mcore_dir / WEIGHTS_DIR, cfg, tmp, HF_DTYPE_NAMES[out_dtype], max_shard_bytes)
        copy_model_side_files(hf_dir, tmp)
        if out_dtype != cfg.torch_dtype:
            config = json.loads((tmp / "config.json").read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = out_dtype
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    logger.info("wrote %s (%.1f MB %s) in %.1fs", out_dir, total / 1e6, out_dtype, time.monotonic() - t0)
    return out_dir


def export_run_checkpoint(run_dir: str | Path, checkpoint: str | Path | None = None) -> Path:
    """HF directory of a training run's checkpoint: `checkpoint`, else its newest intact one
    (sha256-verified), exported once to RUN_DIR/export/step_N and reused afterwards."""
    from megatron_rl.checkpoint import latest_committed

    run_dir = Path(run_dir)
    ckpt = Path(checkpoint) if checkpoint else latest_committed(run_dir / "checkpoints", verify=True)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no intact COMMITTED checkpoint")
    out = run_dir / "export" / ckpt.name
    if not (out / "config.json").is_file():
        convert_mcore_to_hf(ckpt, out, force=out.exists())
    return out
