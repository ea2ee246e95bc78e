"""What a checkpoint of a LoRA learner holds: the adapters (split on their own TP axes) and a record of
which adapters on which base they are.

    sd = adapter_sharded_state_dict(model.sharded_state_dict())   # Learner.sharded_state_dict with lora
    write_adapter_record(weights_dir, lora_cfg)                     # weights/lora.json (rank 0)
    check_adapter_record(weights_dir, lora_cfg)                     # before loading: ConfigError naming the field
    digest = base_digest(model_dir)            # conversion/lora_io.py: the frozen base the adapters belong to
    check_base_digest(ckpt_dir, manifest, digest, model_dir)        # CheckpointError: adapters of another base

The base is frozen, so a checkpoint keeps only the adapter tensors and (Learner.sharded_state_dict
hands this model state to the optimizer) their optimizer state.  Megatron's linear layers take a
child module's tensors as replicated over TP (make_sharded_tensors_for_checkpoint knows only the
layer's own weight and bias), which is right for A of a column-parallel layer and B of a row-parallel
one, and wrong for the split ones (models/tp_layout.py): B of linear_qkv splits on dim 0, B of
linear_fc1 splits each of its [gate; up] halves on dim 0 (the same ShardedTensorFactory Megatron uses
for linear_fc1.weight), A of linear_proj / linear_fc2 on dim 1.  With those axes a checkpoint loads
at another TP / PP, like the base weights.

The base's digest (blake3 over the weight files of the HF directory the learner filled its base
from, conversion/hf_io.py) goes into the checkpoint's COMMITTED manifest (`extra.lora_base_digest`,
train/resume.py lora_record): a resume on another base is refused before Ray or any model starts
(resume.py check_lora, from open_run_dir), and `megatron-rl convert` checks the base it merges into.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.config import ConfigError

RECORD = "lora.json"
BASE_DIGEST = "lora_base_digest"
"""The key of the base's digest in a checkpoint manifest's `extra`."""
_SPLIT_AXIS = {"linear_qkv.adapter.lora_b": 0, "linear_fc1.adapter.lora_b": 0,
               "linear_proj.adapter.lora_a": 1, "linear_fc2.adapter.lora_a": 1}
"""Adapter tensors split over TP -> their split axis (before the prepended layer axis)."""


def _prepended_offsets(sh_ten) -> tuple:
    """The (axis, offset, fragments) of the dimensions a sharded tensor prepends (its layer axis)."""
    return tuple((i, sh_ten.global_offset[i], sh_ten.axis_fragmentations[i]) for i in range(sh_ten.prepend_axis_num))


def adapter_sharded_state_dict(model_sd: dict) -> dict:
    """A GPT model's sharded_state_dict -> its adapter entries only, the split ones on their TP axis."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    out = {}
    for name, sh_ten in model_sd.items():
        if ".adapter.lora_" not in name:
            continue
        suffix = next((s for s in _SPLIT_AXIS if name.endswith(s)), None)
        if suffix is None:  # replicated over TP: Megatron's entry is right
            out[name] = sh_ten
            continue
        offsets = _prepended_offsets(sh_ten)
        split = make_tp_sharded_tensor_for_checkpoint(sh_ten.data, sh_ten.key, tp_axis=_SPLIT_AXIS[suffix],
                                                      prepend_offsets=offsets)
        out[name] = apply_swiglu_sharded_factory(split, offsets) if suffix.startswith("linear_fc1") else split
    if not out:
        raise ValueError("learner.lora.enabled but the model has no adapter tensors to checkpoint")
    return out


def adapter_record(lora_cfg) -> dict:
    """What lora.json says: the adapters' shape and scale (what convert and a resume need)."""
    return lora_cfg.record()


def lora_config_of(record: dict):
    """The LoraConfig (enabled) a checkpoint's lora.json describes."""
    from megatron_rl.models.lora_config import LoraConfig

    return LoraConfig(enabled=True, rank=int(record["rank"]), alpha=float(record["alpha"]),
                      target_modules=list(record["target_modules"]))


def write_adapter_record(weights_dir: str | Path, lora_cfg) -> None:
    """weights/lora.json: the checkpoint holds adapters only (call on one rank)."""
    (Path(weights_dir) / RECORD).write_text(json.dumps(adapter_record(lora_cfg), indent=2, sort_keys=True) + "\n")


def read_adapter_record(weights_dir: str | Path) -> dict | None:
    """The lora.json of a checkpoint's weights/, or None for a full-parameter checkpoint."""
    path = Path(weights_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or not {"rank", "alpha", "target_modules"} <= set(record):
        raise ConfigError(f"{path}: expected rank, alpha and target_modules, got {record!r}")
    return record


def check_adapter_record(weights_dir: str | Path, lora_cfg) -> None:
    """Refuse (ConfigError naming the field) a checkpoint whose weights/ does not fit `lora_cfg`:
    adapters into a full-parameter learner, base weights into a LoRA one, or other adapters."""
    record = read_adapter_record(weights_dir)
    if record is None and lora_cfg.enabled:
        raise ConfigError(f"{weights_dir}: a full-parameter checkpoint (no {RECORD}) cannot be resumed with "
                          "learner.lora.enabled=true; start LoRA from it as a new run (model.init_from)")
    if record is not None and not lora_cfg.enabled:
        raise ConfigError(f"{weights_dir}: the checkpoint holds LoRA adapters only (no base weights); resume it "
                          "with learner.lora.enabled=true and its learner.lora settings")
    if record is None:
        return
    for field, now in adapter_record(lora_cfg).items():
        if record[field] != now:
            raise ConfigError(f"{weights_dir}: its adapters have learner.lora.{field} {record[field]!r}, this run "
                              f"has {now!r}; resume with the checkpoint's learner.lora settings")


def check_base_digest(ckpt_dir: str | Path, manifest: dict, digest: str | None, model_dir: str | Path) -> None:
    """Refuse (CheckpointError) adapters saved on another base than `digest` (that of `model_dir`).
    `digest` None: the run trains every parameter (check_adapter_record refuses adapters then)."""
    from megatron_rl.checkpoint import CheckpointError

    if digest is None:
        return
    saved = (manifest.get("extra") or {}).get(BASE_DIGEST)
    if saved is None:
        raise CheckpointError(f"cannot resume {ckpt_dir} with learner.lora.enabled: it records no LoRA base digest "
                              "(a full-parameter checkpoint); start the LoRA run from it with model.init_from instead")
    if saved != digest:
        raise CheckpointError(f"cannot resume {ckpt_dir}: its LoRA adapters were trained on the base with digest "
                              f"{saved}, but this run's base {model_dir} has digest {digest}; resume with the model "
                              "the adapters belong to, or start a new run directory")
