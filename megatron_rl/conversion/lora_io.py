"""Export a LoRA run's checkpoint: its adapters in the PEFT layout, or merged into a full HF model.

    megatron-rl convert lora-export --mcore RUN_DIR/checkpoints/step_N --out ADAPTER_DIR [--merged HF_DIR]
    megatron-rl convert mcore-to-hf --mcore RUN_DIR/checkpoints/step_N --out HF_DIR   # a LoRA checkpoint: merged

    from megatron_rl.conversion.lora_io import export_lora_checkpoint, read_adapters, write_merged
    adapters, record = read_adapters(ckpt / "weights")            # canonical TP1 tensors, lora.json
    write_merged(base_hf_dir, adapters, lora_cfg, out_dir)         # W + (alpha / r) B A, HF safetensors

A LoRA checkpoint (models/lora_checkpoint.py) holds the adapters and their optimizer state only:
weights/ is a Megatron distributed checkpoint whose model tensors are `decoder.layers.{i}.<linear>.
adapter.lora_{a,b}`, read back whole whatever TP/PP wrote them (conversion/dist_ckpt.py), and
weights/lora.json gives rank, alpha and target modules.  The base is the HF directory the run
started from (run_model.py; or --base): its digest must be the one the checkpoint recorded
(`lora_base_digest` in COMMITTED's extra), else the export is refused, naming both.  The PEFT names and
the merge are conversion/lora_export.py's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from megatron_rl.config import ConfigError
from megatron_rl.conversion import lora_export, mapping

logger = logging.getLogger(__name__)

_ADAPTER_KEY = ".adapter.lora_"


def read_adapters(weights_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """({canonical adapter name: full TP1 tensor}, lora.json) of a LoRA checkpoint's weights/."""
    from megatron_rl.conversion.dist_ckpt import DistCheckpointReader
    from megatron_rl.models.lora_checkpoint import read_adapter_record

    weights_dir = Path(weights_dir)
    record = read_adapter_record(weights_dir)
    if record is None:
        raise ConfigError(f"{weights_dir}: not a LoRA checkpoint (no lora.json); export a full-parameter "
                          "checkpoint with `megatron-rl convert mcore-to-hf`")
    reader = DistCheckpointReader(weights_dir)
    try:
        out = {}
        for key, entry in reader.metadata.state_dict_metadata.items():
            if key.startswith("optimizer.") or _ADAPTER_KEY not in key or not hasattr(entry, "size"):
                continue
            layers = entry.size[0]  # stacked on the layer axis: decoder.layers.<linear path>
            for i in range(layers):
                name = key.replace("decoder.layers.", f"decoder.layers.{i}.", 1)
                out[name] = reader.tensor(name).clone()
    finally:
        reader.close()
    if not out:
        raise ConfigError(f"{weights_dir}: lora.json is there but no adapter tensors are")
    return out, record


def write_peft(adapters: dict[str, torch.Tensor], lora_cfg, hf_cfg, base_name: str, out_dir: str | Path, *,
               force: bool = False) -> Path:
    """adapter_config.json + adapter_model.safetensors in `out_dir` (written whole, then renamed)."""
    from megatron_rl.conversion.hf_io import atomic_output_dir

    tensors = lora_export.peft_tensors(adapters, lora_cfg, hf_cfg)
    with atomic_output_dir(out_dir, force=force) as tmp:
        lora_export.write_peft_dir(tmp, tensors, lora_export.peft_config(lora_cfg, base_name))
    return Path(out_dir)


@torch.no_grad()
def write_merged(base_dir: str | Path, adapters: dict[str, torch.Tensor], lora_cfg, out_dir: str | Path, *,
                 dtype: torch.dtype | None = None, force: bool = False, max_shard_bytes: int = 4 << 30) -> Path:
    """A full HF model: the base's weights with (alpha / r) B A added to each adapted one (in fp32), its
    config and tokenizer; `dtype` None: the base's (config.json's torch_dtype)."""
    from megatron_rl.conversion.hf_io import HFCheckpoint, HFWriter, atomic_output_dir, copy_model_side_files
    from megatron_rl.models.hf_config import load_hf_config

    base_dir = Path(base_dir)
    cfg = load_hf_config(base_dir)  # the merged model's config.json is the base's, dtype included
    tensors = lora_export.peft_tensors(adapters, lora_cfg, cfg)
    base = HFCheckpoint(base_dir, cfg)
    names = [h for e in mapping.name_table(cfg) for h in e.hf]
    shapes = mapping.hf_shapes(cfg)
    with atomic_output_dir(out_dir, force=force) as tmp:
        out_dtype = dtype or getattr(torch, cfg.torch_dtype, None)
        if not isinstance(out_dtype, torch.dtype):
            raise ConfigError(f"{base_dir}/config.json: torch_dtype {cfg.torch_dtype!r} is not a torch dtype; pass --dtype")
        layout = {h: (shapes[h], out_dtype) for h in names}
        writer = HFWriter(tmp, layout, max_shard_bytes=max_shard_bytes)
        for h in names:
            writer.add(h, lora_export.merge_into_hf(h, base.read(h), tensors, lora_cfg).to(layout[h][1]))
        writer.close()
        copy_model_side_files(base_dir, tmp)
        if dtype is not None:  # the config says what the files hold
            config = json.loads((tmp / "config.json").read_text())
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return Path(out_dir)


def run_base_digest(lora_cfg, model_dir: str | Path) -> str | None:
    """What a run with `lora_cfg` (learner.lora) records of its base in each checkpoint (models/lora_checkpoint.py):
    the digest of `model_dir`'s weights when it trains adapters on that frozen base, else None."""
    return base_digest(model_dir) if lora_cfg.enabled else None


def base_digest(model_dir: str | Path) -> str:
    """blake3 of the weight files of the HF model directory a LoRA learner's frozen base comes from
    (recorded in each checkpoint, models/lora_checkpoint.py BASE_DIGEST)."""
    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.models.hf_config import load_hf_config

    return "blake3:" + HFCheckpoint(Path(model_dir), load_hf_config(model_dir)).content_hash()


def checked_base(ckpt_dir: Path, base: str | Path | None) -> Path:
    """The HF directory of a LoRA checkpoint's base: `base`, else the run's model directory; its digest
    must be the one the checkpoint recorded (ConfigError naming both otherwise)."""
    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.models.lora_checkpoint import BASE_DIGEST
    from megatron_rl.models.tokenizer import tokenizer_hash
    from megatron_rl.run_model import training_checkpoint_model_dir

    if base is None:
        model_dir = training_checkpoint_model_dir(ckpt_dir)  # verifies the checkpoint's files and tokenizer
        manifest = load_checkpoint(ckpt_dir, verify=False)
    else:
        model_dir = Path(base)
        manifest = load_checkpoint(ckpt_dir, tokenizer_hash=tokenizer_hash(model_dir))
    saved = (manifest.get("extra") or {}).get(BASE_DIGEST)
    if saved is None:
        logger.warning("%s records no LoRA base digest: cannot check that %s is the base its adapters belong to",
                       ckpt_dir, model_dir)
    elif saved != (digest := base_digest(model_dir)):
        raise ConfigError(f"{ckpt_dir}: its adapters were trained on the base with digest {saved}, but {model_dir} "
                          f"has digest {digest}; pass the right base with --base")
    return model_dir


def export_lora_checkpoint(ckpt_dir: str | Path, out_dir: str | Path | None = None, *, merged: str | Path | None = None,
                           base: str | Path | None = None, dtype: torch.dtype | None = None,
                           force: bool = False) -> list[Path]:
    """Write a committed LoRA checkpoint's adapters as a PEFT directory (`out_dir`) and/or merged into its
    base as a full HF model (`merged`); returns what was written."""
    from megatron_rl.conversion.hf_io import check_output_dir
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora_checkpoint import lora_config_of

    if out_dir is None and merged is None:
        raise ConfigError("nothing to write: give a PEFT output directory, a merged one, or both")
    for out in (o for o in (out_dir, merged) if o is not None):
        check_output_dir(Path(out), force)  # before anything is read; --force never replaces a file
    ckpt_dir = Path(ckpt_dir)
    model_dir = checked_base(ckpt_dir, base)
    adapters, record = read_adapters(ckpt_dir / "weights")
    lora_cfg = lora_config_of(record)  # models/lora_checkpoint.py
    written = []
    if out_dir is not None:
        written.append(write_peft(adapters, lora_cfg, load_hf_config(model_dir), str(model_dir), out_dir, force=force))
    if merged is not None:
        written.append(write_merged(model_dir, adapters, lora_cfg, merged, dtype=dtype, force=force))
    logger.info("exported the LoRA adapters of %s (rank %d, alpha %g) to %s", ckpt_dir, lora_cfg.rank,
                lora_cfg.alpha, ", ".join(map(str, written)))
    return written
