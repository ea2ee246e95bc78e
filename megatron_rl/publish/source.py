"""The Megatron side of publication: a learner's policy as HF-named full tensors, group by group.

    source = MegatronWeightSource(model, hf_cfg)   # on every learner rank, after training steps
    for hf_name, tensor in source: ...              # every rank iterates, in lockstep (collectives);
                                                    # the tensors come out on global rank 0 only
    source.metadata()                               # [(hf_name, dtype, shape)], every rank, no transfer

Per streaming group (embedding, layer.i, final: `mapping.groups`) the pipeline stage that
owns it all-gathers each tensor's TP shards in its TP groups; with PP > 1 the owner's TP
rank 0 of data-parallel replica 0 sends the full tensors to the first stage (point to
point), where global rank 0 maps them to HF names (`mapping.mcore_to_hf_group`, the one
mapping the converter uses) and yields them.  No rank holds more than one group's full
tensors at a time; other data-parallel replicas take no part, except, for a MoE learner at
expert parallel EP > 1, the EP peers of replica 0, which hold the other experts
(`ExpertGather`: each local expert is all-gathered over the EP group).

This has the shape of vLLM's `WeightSource` (metadata() agreeing element by element with
iteration); `as_vllm_source()` wraps it for vLLM's NCCL trainer engine on GPUs without
making CPU learners import vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rl.conversion import mapping
from megatron_rl.conversion.model_io import canonical_params


class MegatronWeightSource:
    """HF-named full tensors of a live Megatron GPTModel stage's whole model (see module doc)."""

    def __init__(self, model, hf_cfg, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from megatron.core import parallel_state as ps

        from megatron_rl.models.hf_config import padded_vocab_size

        self.cfg, self.dtype, self.device = hf_cfg, dtype, device
        self.params = canonical_params(model)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.experts = ExpertGather.for_model(hf_cfg)
        self.is_sender = dist.get_rank() == 0
        self.full_shapes = mapping.mcore_shapes(hf_cfg, padded_vocab_size(hf_cfg.vocab_size, self.tp))
        self.group_names = {g: [e.mcore for e in mapping.name_table(hf_cfg) if e.group == g] for g in mapping.groups(hf_cfg)}
        local = sorted({mapping.group_of(n) for n in self.params})
        if self.pp > 1:
            pp_group = ps.get_pipeline_model_parallel_group()
            self.stage_ranks = dist.get_process_group_ranks(pp_group)  # global rank of each stage, in order
            stages: list = [None] * self.pp
            dist.all_gather_object(stages, local, group=pp_group)
        else:
            self.stage_ranks, stages = [dist.get_rank()], [local]
        # The first stage holding a group provides it (tied embeddings live on the first and last).
        self.owner = {g: next((s for s, groups in enumerate(stages) if g in groups), None) for g in self.group_names}
        missing = [g for g, s in self.owner.items() if s is None]
        if missing:
            raise ValueError(f"no pipeline stage holds group {missing[0]!r}: the model is incomplete")

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(hf_name, dtype, shape) of everything iteration yields, in the same order."""
        shapes = mapping.hf_shapes(self.cfg)
        return [(h, self.dtype, shapes[h]) for g in mapping.groups(self.cfg)
                for e in mapping.name_table(self.cfg) if e.group == g for h in e.hf]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.dp_rank != 0 and not (self.experts and self.experts.takes_part):
            return
        for group, names in self.group_names.items():
            full = self._gather_group(group, names)
            if self.is_sender:
                for hf_name, tensor in mapping.mcore_to_hf_group(self.cfg, group, full):
                    yield hf_name, tensor.to(self.device).contiguous()

    def _gather_group(self, group: str, names: list[str]) -> dict[str, torch.Tensor]:
        """Full tensors of `group` on the first stage's TP rank 0 (and on the owner's TP ranks)."""
        owner = self.owner[group]
        full: dict[str, torch.Tensor] = {}
        if self.pp_rank == owner:
            if self.experts:
                full.update(self.experts.gather(self.params, names, self.dtype))
            for name in names if self.dp_rank == 0 else ():
                if name in full:
                    continue
                full[name] = tp_full(name, self.params[name], self.tp, self.tp_group).to(self.dtype)
        if self.dp_rank != 0:  # an expert-parallel peer of DP replica 0: its experts only
            return full
        if owner != 0 and self.tp_rank == 0 and self.pp_rank in (0, owner):
            for name in names:
                if self.pp_rank == owner:
                    dist.send(full[name].contiguous(), dst=self.stage_ranks[0])
                else:
                    full[name] = torch.empty(self.full_shapes[name], dtype=self.dtype, device=self._device_of_params())
                    dist.recv(full[name], src=self.stage_ranks[owner])
        return full

    def _device_of_params(self) -> torch.device:
        return next(iter(self.params.values())).device


def tp_full(name: str, param: torch.Tensor, world: int, group) -> torch.Tensor:
    """The whole tensor of a parameter sharded over a tensor-parallel `group` of `world` ranks
    (all-gathered and joined along its TP dimension); the parameter itself when not sharded."""
    p = param.detach()
    if world == 1 or mapping.tp_kind(name) == "replicated":
        return p
    shards = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(shards, p.contiguous(), group=group)
    return mapping.tp_gather(name, shards)


class ExpertGather:
    """All of a MoE stage's experts from its expert-parallel group (EP ranks hold E/EP each).

    The ranks of expert-data-parallel replica 0 take part: each all-gathers its experts'
    expert-TP shards, then the EP group all-gathers every local expert's full tensor, so the
    stage's DP replica 0 holds all E experts under their global canonical names."""

    def __init__(self, num_experts: int) -> None:
        from megatron.core import parallel_state as ps

        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.etp = ps.get_expert_tensor_parallel_world_size()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.takes_part = ps.get_expert_data_parallel_rank() == 0
        self.per_rank = num_experts // self.ep

    @classmethod
    def for_model(cls, hf_cfg) -> "ExpertGather | None":
        moe = getattr(hf_cfg, "moe", None)
        return cls(moe.num_experts) if moe else None

    def gather(self, params: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Full tensors of every expert among `names` (global names), from this EP group."""
        if not self.takes_part:
            return {}
        full: dict[str, torch.Tensor] = {}
        for name in (n for n in names if n in params and mapping.is_expert(n)):
            p = tp_full(name, params[name], self.etp, self.etp_group).to(dtype).contiguous()
            if self.ep == 1:
                full[name] = p
                continue
            local = mapping.expert_index(name) - self.ep_rank * self.per_rank
            copies = [torch.empty_like(p) for _ in range(self.ep)]
            dist.all_gather(copies, p, group=self.ep_group)
            for r, t in enumerate(copies):
                full[mapping.with_expert_index(name, r * self.per_rank + local)] = t
        missing = [n for n in names if mapping.is_expert(n) and n not in full]
        if missing:
            raise RuntimeError(f"expert {missing[0]!r} came from no rank of the expert-parallel group")
        return full


def as_vllm_source(source: MegatronWeightSource):
    """`source` as a vllm.distributed.weight_transfer WeightSource (for vLLM's trainer engines)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _VLLMWeightSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in source.metadata()]

        def __iter__(self):
            return iter(source)

    return _VLLMWeightSource()


class FullModelWeights:
    """A full-parameter learner's kind of weights: the whole model is published (MegatronWeightSource) and
    checkpointed.  Its sibling is a LoRA learner's AdapterWeights (publish/adapter_source.py); a rank's WeightIO
    (ranks/weights.py) holds one of the two, chosen once, and never asks which."""

    def __init__(self, module, hf_cfg):
        self.module, self.hf_cfg = module, hf_cfg

    def source(self, device: str, dtype: torch.dtype) -> MegatronWeightSource:
        return MegatronWeightSource(self.module, self.hf_cfg, dtype=dtype, device=device)

    def model_state(self) -> dict | None:
        """The model entries a checkpoint holds: None, the whole model."""
        return None

    def record(self, weights_dir) -> None:
        """Nothing is written beside a full checkpoint's weights."""
