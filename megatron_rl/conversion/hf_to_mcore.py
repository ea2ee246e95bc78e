"""Convert a Hugging Face Llama / Qwen2 checkpoint into a Megatron-Core distributed checkpoint.

    megatron-rl convert hf-to-mcore --hf MODEL_DIR --out MCORE_DIR --tp 2 --pp 2 [--dtype bf16]
    python tools/convert.py hf-to-mcore --hf MODEL_DIR --out MCORE_DIR

    from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
    convert_hf_to_mcore(model_dir, out_dir, tp=2, pp=2, dtype="fp32")

Layer group by layer group, the HF tensors are read from the safetensors files, put in
Megatron's layout by the shared mapping (QKV per GQA group, [gate; up], vocabulary padded for
TP) and written in Megatron-Core's torch_dist distributed-checkpoint format (dist_ckpt.py), so
it loads at any TP/PP; no model is built and one group is in memory at a time.  TP and PP are
checked against the model (heads, KV heads, layers) and TP sets the vocabulary padding.
Everything is checked before work starts (config, architecture, every tensor's shape, the
layout) and written to a temporary sibling directory renamed into place only when complete.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from pathlib import Path

import torch

from megatron_rl.version import __version__
from megatron_rl.conversion import mapping
from megatron_rl.conversion.hf_io import HFCheckpoint, atomic_output_dir, check_output_dir, copy_model_side_files
from megatron_rl.conversion.dist_ckpt import DistCheckpointWriter
from megatron_rl.conversion.model_io import HF_DIR, WEIGHTS_DIR, write_manifest

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_CHOICES = tuple(TORCH_DTYPES)


class GroupProgress:
    """Logs conversion progress every ~10% of groups (and at the last one); at DEBUG for its first 2 s."""

    def __init__(self, what: str) -> None:
        self.what, self.t0, self._next = what, time.monotonic(), 0.1

    def __call__(self, group: str, done: int, total: int) -> None:
        frac = done / max(total, 1)
        if frac >= self._next or done == total:
            elapsed = time.monotonic() - self.t0  # a conversion done in a blink needs no progress on the console
            logger.log(logging.INFO if elapsed >= 2.0 else logging.DEBUG, "%s: %d/%d groups (%s) %.0f%% in %.1fs",
                       self.what, done, total, group, 100 * frac, elapsed)
            self._next = frac + 0.1


def _write_weights(ckpt: HFCheckpoint, cfg, weights_dir: Path, padded_vocab: int, dtype: str) -> int:
    """Stream every layer group: HF tensors -> full Megatron tensors -> the checkpoint. Returns bytes."""
    torch_dtype = TORCH_DTYPES[dtype]
    writer = DistCheckpointWriter(weights_dir, cfg.num_layers, cfg.moe.num_experts if cfg.moe else None)
    progress = GroupProgress("hf-to-mcore")
    all_groups = mapping.groups(cfg)
    buffers = mapping.LayerBuffers()  # each group is written before the next one reuses them
    for i, group in enumerate(all_groups):
        tensors = mapping.hf_to_mcore_group(cfg, group, ckpt.read_group(group), padded_vocab, buffers)
        for name, tensor in tensors.items():
            writer.add(name, tensor.to(torch_dtype))
        progress(group, i + 1, len(all_groups))
    writer.close()
    return writer.total_bytes


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, dtype: str = "fp32",
                        force: bool = False) -> Path:
    """Write `out_dir` (weights/, hf/, manifest.json) from the HF checkpoint in `hf_dir`.

    Raises FileNotFoundError / ValueError naming the bad file, field, tensor or number, and
    FileExistsError for an existing `out_dir` unless `force`; nothing is written then.
    """
    from megatron_rl.models.hf_config import check_parallel_layout, load_hf_config, padded_vocab_size
    from megatron_rl.models.tokenizer import tokenizer_hash

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_output_dir(out_dir, force)
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)}")
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"HF model directory not found: {hf_dir}")
    cfg = load_hf_config(hf_dir)
    check_parallel_layout(cfg, tp, pp)
    ckpt = HFCheckpoint(hf_dir, cfg)  # every tensor present, every shape as config.json implies
    t0 = time.monotonic()
    with atomic_output_dir(out_dir, force=force) as tmp, concurrent.futures.ThreadPoolExecutor(1) as pool:
        source_hash = pool.submit(ckpt.content_hash)  # hashing overlaps the conversion
        _write_weights(ckpt, cfg, tmp / WEIGHTS_DIR, padded_vocab_size(cfg.vocab_size, tp), dtype)
        (tmp / HF_DIR).mkdir()
        copy_model_side_files(hf_dir, tmp / HF_DIR)
        tok_hash = tokenizer_hash(hf_dir) if (hf_dir / "tokenizer.json").is_file() else None
        manifest = write_manifest(
            tmp,
            architecture=cfg.raw.get("architectures", [cfg.arch])[0],
            family=cfg.arch,
            source_name=hf_dir.name,
            source_hash=source_hash.result(),
            source_files=[p.name for p in ckpt.files],
            source_dtype=cfg.torch_dtype,
            dtype=dtype,
            tokenizer_hash=tok_hash,
            tool=f"megatron-rl {__version__}",
            written_tp=tp,
            written_pp=pp,
            vocab_size=cfg.vocab_size,
            padded_vocab_size=padded_vocab_size(cfg.vocab_size, tp),
            tie_word_embeddings=cfg.tie_word_embeddings,
            num_params=sum(math.prod(s) for s in mapping.hf_shapes(cfg).values()),
            created_unix=int(time.time()),
        )
    logger.info("wrote %s (%s, TP%d PP%d, %s) in %.1fs", out_dir, manifest["architecture"], tp, pp, dtype,
                time.monotonic() - t0)
    return out_dir
