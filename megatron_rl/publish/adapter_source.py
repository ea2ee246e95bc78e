"""The learner side of an adapter-only publication: a LoRA run's adapters as PEFT-named full tensors.

    source = AdapterSource(model, hf_cfg, lora_cfg)   # on every learner rank (learner.lora.enabled)
    for peft_name, tensor in source: ...               # every rank iterates (collectives); tensors on rank 0
    source.metadata()                                   # [(peft_name, dtype, shape)], every rank, no transfer
    adapter_shapes(lora_cfg, hf_cfg)                    # {peft_name: shape}: what an engine expects

A LoRA run publishes only its adapters: a few MB per version instead of the whole model, through the same
checksummed, all-or-nothing path (publish/transports.py, the engine's VerifiedCommit), where the engine
installs them as a LoRA adapter of that version (publish/vllm_adapters.py) instead of loading weights.
Each rank's adapter tensors are all-gathered over its TP group into their TP1 layout
(models/tp_layout.py); with PP > 1 every stage sends its layers' adapters to the first stage
(`gather_object`: they are small); global rank 0 maps them to PEFT names (conversion/lora_export.py, the
same names `megatron-rl convert` writes) and yields them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rl.conversion import mapping
from megatron_rl.conversion.lora_export import HF_MODULES, PEFT_PREFIX, peft_tensors
from megatron_rl.models.tp_layout import tp_gather, tp_kind
from megatron_rl.models.lora import canonical_adapters


def adapter_shapes(lora_cfg, hf_cfg) -> dict[str, tuple[int, ...]]:
    """PEFT name -> shape of every tensor an adapter publication of `lora_cfg` on this model holds:
    lora_A [r, in] and lora_B [out, r] of each targeted HF linear of each layer."""
    shapes = mapping.hf_shapes(hf_cfg)
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(hf_cfg.num_layers):
        for target in lora_cfg.target_modules:
            for module in HF_MODULES[target]:
                base = f"model.layers.{layer}.{module}"
                out_features, in_features = shapes[f"{base}.weight"]
                out[f"{PEFT_PREFIX}{base}.lora_A.weight"] = (lora_cfg.rank, in_features)
                out[f"{PEFT_PREFIX}{base}.lora_B.weight"] = (out_features, lora_cfg.rank)
    return out


class AdapterSource:
    """PEFT-named full adapter tensors of a live LoRA GPTModel stage (see the module docstring)."""

    def __init__(self, model, hf_cfg, lora_cfg, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from megatron.core import parallel_state as ps

        self.cfg, self.lora, self.dtype, self.device = hf_cfg, lora_cfg, dtype, device
        self.local = canonical_adapters(model)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        self.first_stage = dist.get_process_group_ranks(self.pp_group)[0] if self.pp > 1 else dist.get_rank()
        self.is_sender = dist.get_rank() == 0

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(peft_name, dtype, shape) of everything iteration yields, in the same order."""
        return [(name, self.dtype, shape) for name, shape in sorted(adapter_shapes(self.lora, self.cfg).items())]

    def _stage_full(self) -> dict[str, torch.Tensor]:
        """This stage's adapters in their TP1 layout (every TP rank takes part in each gather)."""
        full = {}
        for name, shard in sorted(self.local.items()):
            shard = shard.detach()
            if self.tp > 1 and tp_kind(name) != "replicated":
                parts = [torch.empty_like(shard) for _ in range(self.tp)]
                dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
                shard = tp_gather(name, parts)
            full[name] = shard.to("cpu", torch.float32)
        return full

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        full = self._stage_full()
        if self.pp > 1:
            stages = [None] * self.pp if dist.get_rank() == self.first_stage else None
            dist.gather_object(full, stages, dst=self.first_stage, group=self.pp_group)
            if stages is not None:
                full = {name: t for stage in stages for name, t in stage.items()}
        if not self.is_sender:
            return
        tensors = peft_tensors(full, self.lora, self.cfg)
        for name in sorted(tensors):
            yield name, tensors[name].to(device=self.device, dtype=self.dtype).contiguous()


class AdapterWeights:
    """A LoRA learner's kind of weights: its adapters alone are published (AdapterSource, PEFT-named) and
    checkpointed (the base is frozen and comes from the run's model), with weights/lora.json saying so.  The
    sibling of publish/source.py FullModelWeights."""

    def __init__(self, module, hf_cfg, lora_cfg):
        self.module, self.hf_cfg, self.lora_cfg = module, hf_cfg, lora_cfg

    def source(self, device: str, dtype: torch.dtype) -> AdapterSource:
        return AdapterSource(self.module, self.hf_cfg, self.lora_cfg, dtype=dtype, device=device)

    def model_state(self) -> dict:
        """The model entries a checkpoint holds: the adapters alone."""
        from megatron_rl.models.lora_checkpoint import adapter_sharded_state_dict

        return adapter_sharded_state_dict(self.module.sharded_state_dict())

    def record(self, weights_dir) -> None:
        """weights/lora.json: the adapters' settings (a resume and `convert lora-export` read them)."""
        from megatron_rl.models.lora_checkpoint import write_adapter_record

        write_adapter_record(weights_dir, self.lora_cfg)


def rank_weights(module, hf_cfg, lora_cfg):
    """What a learner rank with `lora_cfg` (learner.lora) publishes and checkpoints, chosen once: a LoRA
    learner's AdapterWeights, else the whole model's FullModelWeights (publish/source.py).  `module`: the
    rank's unwrapped model chunk."""
    from megatron_rl.publish.source import FullModelWeights

    return AdapterWeights(module, hf_cfg, lora_cfg) if lora_cfg.enabled else FullModelWeights(module, hf_cfg)
