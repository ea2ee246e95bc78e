"""Host memory per node at resume: the planner's row for it (issue 31, item 8).

    host = resume_host_memory(model, lay, roll, gpus_per_node=8, sleep_mode=True, rollback_copy=True)
    host.per_node_bytes, host.items                       # bytes per node, by item
    host_memory_problem(host, cluster_host_gib=512)       # None, or why the recipe does not fit

Megatron's distributed-optimizer checkpoint load (the `fully_reshardable` format the learner saves,
Learner.OPTIMIZER_CKPT_METADATA) allocates, on every rank, fp32 world tensors for that rank's whole
model-parallel shard before it keeps its data-parallel part: the fp32 master weights and Adam's m and
v, 12 bytes per parameter of the stage, not divided by DP.  The load then concatenates each SwiGLU
linear_fc1 (gate and up, which the checkpoint holds as two halves: Megatron's ShardedTensorFactory,
apply_factory_merges) into new host tensors, so its parameters are held twice: 12 B more per fc1
parameter, about 18 B per stage parameter for Qwen2 / Llama shapes (fc1 is half of their weights).
Measured at TP1 x DP2 by tests/dist/test_optimizer_checkpoint.py (CPU tensor bytes at the load's
peak, torch's profiler): 12 B per parameter + 12 B per fc1 parameter, within 1%.  For the 7B at TP4
that is (7.6e9 + 3.8e9) / 4 x 12 B = 32 GiB per rank, on every rank at once.  Next to it, on a
colocated node, each engine keeps its weights in host memory while it sleeps (vLLM sleep level 1,
rollout/sleep.py) and a rollback copy of the serving weights (rollout.keep_rollback_copy).

    optimizer_load   = ranks per node x (P_stage + F_stage) x 12     P_stage = P / (TP x PP), learner ranks
                       (MoE: the experts' P_exp / (EP x TP x PP): a rank's shard holds E / EP experts)
                       F_stage = L x 2 h x f / (TP x PP), the fc1 share (MoE: f = E / EP x F_e, the experts')
                       (LoRA: A_stage, the adapters' share of the GPU, ledger.py, instead of P_stage, and
                       fc1's lora_B, L / PP x r x 2 f / TP when fc1 takes adapters, instead of F_stage)
    engine_sleep     = engines per node x P / TP_r x bytes(engine dtype)   (when the engines sleep)
    rollback_copy    = engines per node x P / TP_r x bytes(engine dtype)   (keep_rollback_copy)
    audit_ring       = ranks per node x P_stage x bytes(learner dtype) x (K + 1)   (audit.every > 0)

The audit's ring (audit/ring.py) is held for the whole run, so it sits next to every other item: each
learner rank keeps K = coordinator.max_version_lag + 1 versions of its shard (AuditConfig.ring_versions)
and sets its live weights aside in host memory while an audit scores (the + 1).

A node holds min(GPUs per node, learner GPUs) learner ranks and as many engine GPUs (colocated: one
learner rank and one engine worker per GPU).  Process overheads (Python, CUDA, Ray) are not
counted: they are what the cluster.reserve_fraction keeps back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.planner.ledger import (GIB, LearnerLayout, ModelDims, RolloutLayout, _bytes, adapter_params,
                                        shard_params)

OPTIMIZER_LOAD_BYTES = 12  # fp32 master + Adam m + v, per parameter of the rank's stage, and again per fc1 parameter


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory per node at resume, by item."""

    items: dict[str, float] = field(default_factory=dict)

    @property
    def per_node_bytes(self) -> float:
        return sum(self.items.values())


def swiglu_fc1_params(model: ModelDims, lay: LearnerLayout) -> float:
    """F_stage: the linear_fc1 parameters (gate and up) on one learner rank, which a load holds twice;
    with LoRA, fc1's lora_B (0 when fc1 takes no adapters)."""
    width = model.num_experts // lay.ep * model.moe_ffn_hidden_size if model.num_experts else model.intermediate_size
    dense_fc1 = model.num_layers * 2 * model.hidden_size * width / (lay.tp * lay.pp)
    return lay.training.fc1_loaded_twice(model, lay, dense_fc1)


def stage_params(model: ModelDims, lay: LearnerLayout) -> float:
    """P_stage: the parameters of one learner rank's model-parallel shard; the experts are split over EP too."""
    return sum(shard_params(model, lay))


def resume_host_memory(model: ModelDims, lay: LearnerLayout, roll: RolloutLayout, *, gpus_per_node: int,
                       sleep_mode: bool, rollback_copy: bool, audit_ring_versions: int = 0) -> HostMemory:
    """The module doc's formulas for the most loaded node."""
    if gpus_per_node < 1:
        raise ValueError(f"cluster.gpus_per_node must be >= 1, got {gpus_per_node}")
    ranks = min(gpus_per_node, lay.gpus)
    engines = min(gpus_per_node, roll.gpus)
    p_stage = stage_params(model, lay)
    engine_weights = model.num_params / roll.tp * _bytes(roll.dtype)
    trained = lay.training.trained(p_stage, adapter_params(model, lay))
    return HostMemory({
        "optimizer_load": ranks * (trained + swiglu_fc1_params(model, lay)) * OPTIMIZER_LOAD_BYTES,
        "engine_sleep": engines * engine_weights if sleep_mode else 0.0,
        "rollback_copy": engines * engine_weights if rollback_copy else 0.0,
        "audit_ring": ranks * p_stage * _bytes(lay.dtype) * (audit_ring_versions + 1) if audit_ring_versions else 0.0,
    })


def host_memory_problem(host: HostMemory, host_memory_gib: float | None, reserve_fraction: float = 0.0) -> str | None:
    """Why the node's host memory cannot hold a resume (naming the field and the numbers), or None
    (also when cluster.host_memory_gib is not set)."""
    if host_memory_gib is None:
        return None
    usable = host_memory_gib * GIB * (1 - reserve_fraction)
    if host.per_node_bytes <= usable:
        return None
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in host.items.items() if v)
    return (f"resume needs {host.per_node_bytes / GIB:.1f} GiB of host memory per node ({parts} GiB) but "
            f"cluster.host_memory_gib = {host_memory_gib:g} leaves {usable / GIB:.1f} GiB after "
            f"cluster.reserve_fraction {reserve_fraction:g}")
