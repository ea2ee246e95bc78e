"""LoRA adapters of the learner (models/lora.py) in the PEFT layout that transformers + PEFT and vLLM load.

    from megatron_rl.conversion.lora_export import peft_tensors, peft_config, merge_into_hf
    adapters = {name: tp_gather(name, shards) for name, shards in ...}   # canonical names, TP1 tensors
    tensors = peft_tensors(adapters, lora_cfg, hf_cfg)   # {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ...}
    config = peft_config(lora_cfg, "Qwen/Qwen2.5-0.5B")  # adapter_config.json's contents
    write_peft_dir(out_dir, tensors, config)             # adapter_config.json + adapter_model.safetensors
    w = merge_into_hf("model.layers.0.self_attn.q_proj.weight", w, tensors, lora_cfg)   # W + (alpha/r) B A

Pure tensor code (no torch.distributed, no model): the same names serve `megatron-rl convert` and the
adapters' publication to vLLM.  Legend: r = lora.rank, H hidden, hd head dim, nq query heads, ng KV groups,
qpg = nq // ng, F the MLP width.

Input: the adapters at TP1 under canonical names (global layer index, conversion/mapping.py):
`decoder.layers.{i}.self_attention.linear_qkv.adapter.lora_a` [r, H], `...lora_b` [ng*(qpg+2)*hd, r], and
the same for linear_proj, mlp.linear_fc1, mlp.linear_fc2 (a leading wrapper prefix such as `module.` is
ignored).  PEFT computes W x + (lora_alpha / r) lora_B lora_A x per HF linear, so:
  qkv   one A serves q, k and v (A x is shared): lora_A of q_proj/k_proj/v_proj are copies of A; B's rows
        follow linear_qkv.weight's per-group interleave [q heads of g; k_g; v_g] and split like it
        (mapping.qkv_mcore_to_hf): q_proj B [nq*hd, r], k_proj / v_proj B [ng*hd, r].
  fc1   A serves gate_proj and up_proj; B [2F, r] = [gate; up] splits into halves.
  proj  o_proj (A [r, nq*hd], B [H, r]);  fc2  down_proj (A [r, F], B [H, r]).
r and lora_alpha are the learner's, so alpha / r is unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

import torch

from megatron_rl.conversion import mapping

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_MODULES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "proj": ("self_attn.o_proj",),
              "fc1": ("mlp.gate_proj", "mlp.up_proj"), "fc2": ("mlp.down_proj",)}
"""learner.lora.target_modules name -> the HF linear modules (under model.layers.{i}.) it covers."""
_LINEAR_TARGET = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
_ADAPTER_NAME = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_\w+)\.adapter\.lora_([ab])$")


def _parse(name: str) -> tuple[int, str, str]:
    """(layer, target, "a" | "b") of a canonical adapter tensor name; ValueError for any other name."""
    m = _ADAPTER_NAME.search(name)
    if m is None or m.group(2) not in _LINEAR_TARGET:
        raise ValueError(f"{name!r} is not a LoRA adapter tensor name (decoder.layers.N.<attention or mlp>."
                         f"linear_{{qkv,proj,fc1,fc2}}.adapter.lora_{{a,b}})")
    return int(m.group(1)), _LINEAR_TARGET[m.group(2)], m.group(3)


def _pairs(adapters: Mapping[str, torch.Tensor], num_layers: int) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, target): {"a": A, "b": B}}, every pair complete and every layer in the model."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        layer, target, which = _parse(name)
        if layer >= num_layers:
            raise ValueError(f"{name}: layer {layer} is past the model's {num_layers} layers")
        if which in pairs.setdefault((layer, target), {}):
            raise ValueError(f"{name}: a second lora_{which} for layer {layer} {target} (two wrapper prefixes?)")
        pairs[(layer, target)][which] = tensor
    for (layer, target), pair in pairs.items():
        if set(pair) != {"a", "b"}:
            missing = "lora_b" if "a" in pair else "lora_a"
            raise ValueError(f"layer {layer} {target}: the adapter's {missing} is missing")
    return pairs


def _split_b(target: str, b: torch.Tensor, hf_cfg) -> tuple[torch.Tensor, ...]:
    """B [out, r] of one Megatron linear -> B of each HF module it covers (HF_MODULES order)."""
    if target == "qkv":
        return mapping.qkv_mcore_to_hf(hf_cfg, b)  # per-group interleave -> q [nq*hd, r], k, v [ng*hd, r]
    if target == "fc1":
        gate, up = torch.chunk(b, 2, dim=0)  # [2F, r] = [gate; up]
        return gate.contiguous(), up.contiguous()
    return (b,)


def peft_tensors(adapters_tp1: Mapping[str, torch.Tensor], lora_cfg, hf_cfg) -> dict[str, torch.Tensor]:
    """The learner's TP1 adapters (canonical names) -> PEFT tensors by PEFT name, in layer order.

    `lora_cfg` is a LoraConfig (its rank is checked against every A and B), `hf_cfg` the base model's
    HFModelConfig.  Raises ValueError naming a tensor that is unknown, unpaired or of the wrong shape.
    """
    shapes = mapping.hf_shapes(hf_cfg)
    r = lora_cfg.rank
    out: dict[str, torch.Tensor] = {}
    for (layer, target), pair in sorted(_pairs(adapters_tp1, hf_cfg.num_layers).items()):
        a, b = pair["a"], pair["b"]
        if a.dim() != 2 or a.shape[0] != r or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"layer {layer} {target}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} are not "
                             f"[{r}, in] / [out, {r}] for learner.lora.rank {r}")
        for module, b_part in zip(HF_MODULES[target], _split_b(target, b, hf_cfg)):
            base = f"model.layers.{layer}.{module}"
            out_features, in_features = shapes[f"{base}.weight"]
            if a.shape[1] != in_features or b_part.shape[0] != out_features:
                raise ValueError(f"layer {layer} {target}: lora_a {tuple(a.shape)} / lora_b part {tuple(b_part.shape)} "
                                 f"do not fit {base}.weight [{out_features}, {in_features}]")
            out[f"{PEFT_PREFIX}{base}.lora_A.weight"] = a.contiguous().clone()
            out[f"{PEFT_PREFIX}{base}.lora_B.weight"] = b_part.contiguous().clone()
    return out


def peft_target_modules(lora_cfg) -> list[str]:
    """The HF module names (q_proj, o_proj, ...) the learner's target modules cover, sorted."""
    return sorted(m.rsplit(".", 1)[-1] for t in lora_cfg.target_modules for m in HF_MODULES[t])


def peft_config(lora_cfg, base_name: str) -> dict:
    """adapter_config.json for adapters trained with `lora_cfg` on the base model `base_name`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_name),
            "r": int(lora_cfg.rank), "lora_alpha": float(lora_cfg.alpha), "lora_dropout": float(lora_cfg.dropout),
            "target_modules": peft_target_modules(lora_cfg), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True, "modules_to_save": None,
            "init_lora_weights": True, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_peft_dir(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: dict) -> Path:
    """Write adapter_config.json and adapter_model.safetensors into `out_dir` (created if needed)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def merge_into_hf(hf_name: str, weight: torch.Tensor, tensors: Mapping[str, torch.Tensor], lora_cfg) -> torch.Tensor:
    """An HF weight with its adapter folded in: W + (alpha / r) B A in fp32, cast back to W's dtype.
    Weights without an adapter come back as they are."""
    base = hf_name.removesuffix(".weight")
    a = tensors.get(f"{PEFT_PREFIX}{base}.lora_A.weight")
    if a is None:
        return weight
    b = tensors[f"{PEFT_PREFIX}{base}.lora_B.weight"]
    delta = (b.float() @ a.float()) * lora_cfg.scaling  # [out, r] @ [r, in]
    return (weight.float() + delta).to(weight.dtype)
