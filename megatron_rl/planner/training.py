"""What a learner trains, as the planner's ledgers count it: every parameter (FULL), or LoRA adapters on a frozen
base (AdapterTraining).  Chosen once, from learner.lora (plan_cli.py); the ledgers (ledger.py, host_memory.py)
ask it for each LoRA-dependent term instead of testing for LoRA themselves.

    lay = LearnerLayout(tp=2, training=AdapterTraining(rank=8, targets=("qkv", "proj", "fc1", "fc2")))
    lay.training.adapter_params(model, lay)     # A_stage: the adapters on one GPU of a pipeline stage
"""

from __future__ import annotations

from dataclasses import dataclass

# `model` is a planner/ledger.py ModelDims and `lay` its LearnerLayout, which holds one of these: not imported
# here (ledger.py imports this module).


@dataclass(frozen=True)
class FullTraining:
    """Every parameter trains: grads, master weights and optimizer states for the whole shard."""

    def adapter_params(self, model, lay) -> float:
        return 0.0

    def trained(self, stage_params: float, adapters: float) -> float:
        """The parameters of one GPU's shard that take grads and optimizer state."""
        return stage_params

    def trained_experts(self, expert_params: float) -> float:
        return expert_params

    def ddp_bucket(self, bucket_params: int, adapters: float) -> float:
        """Parameters in one of the two DDP gradient buckets."""
        return bucket_params

    def fc1_loaded_twice(self, model, lay, dense_fc1: float) -> float:
        """F_stage of host_memory.py: the fc1 parameters an optimizer load holds twice."""
        return dense_fc1

    def describe(self, model, lay) -> dict | None:
        """The plan's "lora" entry: None, nothing but the model trains."""
        return None

    def rollback_copy(self, keep: bool) -> bool:
        """Whether the engines hold a host copy of the weights to roll back to (rollout.keep_rollback_copy)."""
        return keep


@dataclass(frozen=True)
class AdapterTraining:
    """LoRA (learner.lora): rank-`rank` adapters beside the `targets` train; the base, experts included, is frozen."""

    rank: int
    targets: tuple[str, ...]

    def adapter_params(self, model, lay) -> float:
        """A_stage: a column-parallel target (qkv, fc1) splits lora_B over TP, a row-parallel one (proj, fc2)
        lora_A (models/lora.py's TP split)."""
        h, f, tp, q = model.hidden_size, model.intermediate_size, lay.tp, model.num_heads * model.head_dim
        qkv_out = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        per_target = {"qkv": h + qkv_out / tp, "proj": q / tp + h, "fc1": h + 2 * f / tp, "fc2": f / tp + h}
        return model.num_layers / lay.pp * self.rank * sum(per_target[t] for t in self.targets)

    def trained(self, stage_params: float, adapters: float) -> float:
        return adapters

    def trained_experts(self, expert_params: float) -> float:
        return 0.0

    def ddp_bucket(self, bucket_params: int, adapters: float) -> float:
        return min(bucket_params, adapters)  # fewer adapters than a bucket holds: one smaller bucket

    def fc1_loaded_twice(self, model, lay, dense_fc1: float) -> float:
        """fc1's lora_B (gate and up halves, split over TP), 0 when fc1 takes no adapter."""
        if "fc1" not in self.targets:
            return 0.0
        return model.num_layers / lay.pp * self.rank * 2 * model.intermediate_size / lay.tp

    def describe(self, model, lay) -> dict | None:
        return {"rank": self.rank, "target_modules": list(self.targets),
                "adapter_params_per_gpu": self.adapter_params(model, lay)}

    def rollback_copy(self, keep: bool) -> bool:
        """Never: the engines keep earlier versions' adapters (publish/vllm_adapters.py), not a copy of the base."""
        return False


FULL = FullTraining()


def training_of(lora) -> FullTraining | AdapterTraining:
    """What a learner with `lora` (learner.lora, models/lora_config.py LoraConfig) trains: chosen here once."""
    return AdapterTraining(rank=lora.rank, targets=tuple(lora.target_modules)) if lora.enabled else FULL


def describe_lines(entry: dict | None) -> list[str]:
    """The plan's text for its "lora" entry (`describe`): nothing for full training."""
    if not entry:
        return []
    return [f"LoRA: rank {entry['rank']} on {', '.join(entry['target_modules'])}; the base is frozen, "
            f"{entry['adapter_params_per_gpu'] / 1e6:.2f} M adapter parameters per GPU train (grads, optimizer state)"]
