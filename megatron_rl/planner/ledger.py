"""Capacity planner: a per-GPU memory ledger for learner and rollout roles, before submitting.

    megatron-rl plan --config configs/qwen2_7b_8gpu_colocated.yaml [--json]

Every number is a closed-form estimate, documented next to its formula, in bytes:

  learner (per GPU, model sharded over TP x PP, optimizer state over DP when distributed):
    weights      = P_stage x bytes(dtype)                       P_stage = P / (TP x PP)
    grads        = P_stage x bytes(grad)       (Megatron DDP grad buffer; fp32 when grad_reduce_in_fp32)
    master       = P_stage x 4 / DP_opt        (fp32 copy of bf16 params; 0 in fp32 training)
    optimizer    = P_stage x 8 / DP_opt        (Adam m and v in fp32)
        -> 16 bytes/param in fp32 training, 18 in bf16 with fp32 grads, unsharded (the 12-20 range)
    reference    = P_stage x bytes(dtype)      (frozen reference model for the KL term, if used)
    activations  = L_stage x n_inflight x s x b x h x (10 + 24/TP) bytes, with flash attention
                   (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2 without the
                   softmax term); x 34/TP instead with sequence parallelism (their eq. 4; the learner
                   runs it for MoE at TP > 1: learner/config.py uses_sequence_parallel); with full
                   activation checkpointing only the layer inputs are kept:
                   L_stage x n_inflight x 2 s b h (/ TP with sequence parallelism)  +  one layer's full
                   activations.
                   n_inflight = PP for the first 1F1B stage (it holds PP micro-batches), 1 otherwise.
    logits       = b x s x V / TP x 4 x 2       (fp32 logits and their gradient on the last stage)
    comm buffers = 2 x bucket x bytes(grad)     (double-buffered DDP buckets)
    cuda context = a fixed allowance for the process's CUDA context and NCCL communicators
    publish      = 2 x V x h x bytes(publish dtype)  (one streamed group, the embedding, gathered
                   over TP and its full tensor, in the engine's dtype: publish.source), freed after
                   the publication
    publish_staging = P x bytes(publish dtype), instead, with the ipc transport, on every GPU that
                   runs an engine: the publishing rank, and one learner rank on each other engine
                   GPU, copy every publication into a staging buffer kept from one step to the next
                   (publish/ipc_staging.py): resident, like the weights
  MoE learners (Qwen3-MoE: E experts of width F_e, top-k, expert parallel EP, expert TP = TP):
    P splits into P_exp = L x E x 3 h F_e (expert MLPs) and P_dense (attention, norms, embeddings and
    the routers, L x E x h, replicated over TP and EP).  Experts are sharded over EP x TP x PP and their
    optimizer state over the expert data-parallel group DP / EP, dense params as above:
    expert_weights / expert_grads / expert_master_weights / expert_optimizer_states
                 = P_exp / (EP x TP x PP) x (bytes(dtype), bytes(grad), 4 / (DP/EP), 8 / (DP/EP))
    moe_dispatch = L_stage x n_inflight x s x b x k x (2 h + 3 F_e / TP) x bytes(dtype)
                   (the k routed copies of each token and the experts' SwiGLU intermediates; the
                   dense-MLP part of the activation formula is left in, a small overcount); with
                   full activation checkpointing one layer's worth: s x b x k x (...)
  LoRA learners (learner.lora: rank r on the target modules, the base frozen): only the adapters train.
    A_stage = L_stage x r x (per target: in + out / TP of a column-parallel layer (qkv, fc1), in / TP + out
    of a row-parallel one (proj, fc2)), the adapters' share of one GPU (models/lora.py's TP split), so
    grads, master_weights, optimizer_states = A_stage x (bytes(grad), 4 / DP_opt, 8 / DP_opt), the DDP
    buckets hold at most A_stage, weights = (P_stage + A_stage) x bytes(dtype), and the experts' grads,
    master weights and optimizer states are 0 (they take no adapters).
  rollout (per GPU of one vLLM group with tensor parallel TP_r):
    weights      = P / TP_r x bytes(dtype)
    kv cache     = M_KV = 2 x B x L x H_kv x d x T x bytes(dtype) / TP_r
    runtime      = a fixed allowance for CUDA context, graphs and sampler workspaces
    unused budget = gpu_memory_utilization x GPU memory - the above (vLLM claims its whole budget
                   at start-up and gives the rest to the KV cache), when the budget is known
  reserve        = reserve_fraction x (sum of the above)   (fragmentation, allocator caches)

Placement: disaggregated learners and rollout groups each need their own GPUs to fit.
Colocated roles share the GPUs and the learner keeps its weights, gradients and optimizer state
resident while vLLM generates, so the peak is the larger of
    rollout phase  learner resident (all but activations/logits/publish) + the engine's budget
    refit phase    learner resident + its publication + the engine's budget (awake to load)
    learn phase    learner total but its streamed publication (freed once sent) + the
                   sleeping engine (its runtime allowance) with vLLM's sleep mode, or + the
                   engine's whole budget without it.
An engine whose own need exceeds its budget does not fit either (vLLM refuses to start).
A placement that cannot start on GPUs whatever its memory (colocated with rollout TP>1: the rule
of planner/startability.py, also Placement.create's) does not fit either: its verdict carries the reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.learner.config import world_size
from megatron_rl.planner.training import FULL, AdapterTraining, FullTraining

GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The few model numbers memory depends on (read from an HF config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    """MoE experts per layer (0: dense MLP of intermediate_size)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's SwiGLU width (moe_intermediate_size)."""
    moe_top_k: int = 0
    """Experts per token."""
    qk_layernorm: bool = False

    @property
    def expert_params(self) -> int:
        """Parameters of all experts' MLPs (0 for a dense model)."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def num_params(self) -> int:
        """Exact parameter count of a Llama/Qwen2/Qwen3(-MoE) decoder (biases ignored: < 0.01%)."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        attn += 2 * d if self.qk_layernorm else 0
        mlp = 3 * h * f if not self.num_experts else self.num_experts * h  # MoE: the router; experts below
        norms = 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + h + self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: top_k of the experts)."""
        if not self.num_experts:
            return self.num_params
        return self.num_params - self.expert_params * (self.num_experts - self.moe_top_k) // self.num_experts


def dims_from_hf(hf) -> ModelDims:
    """ModelDims of an HFModelConfig (megatron_rl.models.hf_config), experts included."""
    moe = getattr(hf, "moe", None)
    return ModelDims(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                     num_layers=hf.num_layers, num_heads=hf.num_heads, num_kv_heads=hf.num_kv_heads,
                     head_dim=hf.head_dim, tie_word_embeddings=hf.tie_word_embeddings,
                     qk_layernorm=bool(getattr(hf, "qk_layernorm", False)),
                     num_experts=moe.num_experts if moe else 0, moe_ffn_hidden_size=moe.ffn_hidden_size if moe else 0,
                     moe_top_k=moe.top_k if moe else 0)


@dataclass(frozen=True, kw_only=True)
class LearnerLayout:
    """How the learner is parallelised and what one micro-batch holds."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert parallel size (MoE), within dp."""
    dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True
    use_distributed_optimizer: bool = True
    micro_batch_size: int = 1
    cuda_context_gib: float = 1.0
    publish_dtype: str = "bf16"
    publish_whole_model: bool = False
    """ipc transport: the learner keeps a staging copy of the whole published model (resident)."""
    seq_length: int = 1024
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    """Activations split over TP along the sequence too (the learner's rule: MoE at TP > 1)."""
    reference_model: bool = True
    ddp_bucket_params: int = 40_000_000
    training: FullTraining | AdapterTraining = FULL
    """What trains: every parameter, or learner.lora's adapters on a frozen base (planner/training.py)."""

    @property
    def gpus(self) -> int:
        return world_size(self.tp, self.pp, self.dp)


@dataclass(frozen=True, kw_only=True)
class RolloutLayout:
    """One vLLM group: its tensor parallel size and the batch it keeps resident."""

    tp: int = 1
    groups: int = 1
    dtype: str = "bf16"
    max_num_seqs: int = 64
    max_model_len: int = 2048
    runtime_gib: float = 2.0
    gpu_memory_utilization: float | None = None  # vLLM's budget fraction (None: unknown, CPU)

    @property
    def gpus(self) -> int:
        return self.tp * self.groups


@dataclass(frozen=True, kw_only=True)
class Ledger:
    """Bytes per GPU by item, for one role."""

    role: str
    items: dict[str, float] = field(default_factory=dict)
    need: float = 0.0
    """What the role itself needs (rollout: without the unused budget; learner: total)."""
    budget: float | None = None
    """The most the role may take (rollout: gpu_memory_utilization x GPU memory), if known."""

    @property
    def total(self) -> float:
        return sum(self.items.values())

    def resident(self, transient: tuple[str, ...] = ("activations", "logits", "publish", "moe_dispatch")) -> float:
        """Bytes kept between steps: everything but the transient items (reserve scaled alike)."""
        base = sum(v for k, v in self.items.items() if k != "reserve")
        kept = sum(v for k, v in self.items.items() if k != "reserve" and k not in transient)
        return self.total * (kept / base) if base else 0.0

    def largest(self) -> str:
        return max(self.items, key=self.items.get)


def _bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def adapter_params(model: ModelDims, lay: LearnerLayout) -> float:
    """A_stage: the LoRA adapter parameters on one GPU of a pipeline stage (0 without LoRA)."""
    return lay.training.adapter_params(model, lay)


def shard_params(model: ModelDims, lay: LearnerLayout) -> tuple[float, float]:
    """(dense, expert) parameters of one learner rank's shard: dense over TP x PP, experts over EP x TP x PP."""
    dense, experts = model.num_params - model.expert_params, model.expert_params
    return dense / (lay.tp * lay.pp), experts / (lay.ep * lay.tp * lay.pp)


def learner_ledger(model: ModelDims, lay: LearnerLayout, reserve_fraction: float) -> Ledger:
    """Per-GPU memory of the most loaded learner rank (first pipeline stage, last for logits)."""
    if model.num_experts and (model.num_experts % lay.ep or lay.dp % lay.ep):
        raise ValueError(f"expert parallel size {lay.ep} must divide num_experts {model.num_experts} and dp {lay.dp}")
    p_stage = shard_params(model, lay)[0]
    w = _bytes(lay.dtype)
    grad_b = 4 if (lay.grad_reduce_in_fp32 or lay.dtype == "fp32") else w
    dp_opt = lay.dp if lay.use_distributed_optimizer else 1
    layers_stage = model.num_layers / lay.pp
    s, b, h = lay.seq_length, lay.micro_batch_size, model.hidden_size
    inflight = lay.pp  # first stage of 1F1B holds pp micro-batches
    full_layer = s * b * h * (34 / lay.tp if lay.sequence_parallel else 10 + 24 / lay.tp)
    if lay.activation_checkpointing:
        act = layers_stage * inflight * 2 * s * b * h / (lay.tp if lay.sequence_parallel else 1) + full_layer
    else:
        act = layers_stage * inflight * full_layer
    adapters = adapter_params(model, lay)
    trained = lay.training.trained(p_stage, adapters)  # LoRA: the base is frozen, the adapters train
    items = {
        "weights": (p_stage + adapters) * w,
        "grads": trained * grad_b,
        "master_weights": 0.0 if lay.dtype == "fp32" else trained * 4 / dp_opt,
        "optimizer_states": trained * 8 / dp_opt,
        "reference_model": p_stage * w if lay.reference_model else 0.0,
        "activations": act,
        "logits": b * s * model.vocab_size / lay.tp * 4 * 2,
        "comm_buffers": 2 * lay.training.ddp_bucket(lay.ddp_bucket_params, adapters) * grad_b,
        "cuda_context": lay.cuda_context_gib * GIB,
    }
    if lay.publish_whole_model:
        items["publish_staging"] = model.num_params * _bytes(lay.publish_dtype)
    else:
        items["publish"] = 2 * model.vocab_size * h * _bytes(lay.publish_dtype)
    if model.num_experts:
        # With full recomputation one layer's dispatch is live at a time (as for the dense activations).
        items.update(_expert_items(model, lay, grad_b, 1 if lay.activation_checkpointing else layers_stage * inflight))
    items["reserve"] = reserve_fraction * sum(items.values())
    total = sum(items.values())
    return Ledger(role="learner", items=items, need=total)


def _expert_items(model: ModelDims, lay: LearnerLayout, grad_b: int, layer_passes: float) -> dict[str, float]:
    """The MoE rows of the learner ledger (see the module doc); the reference model holds experts too."""
    e_shard = shard_params(model, lay)[1]
    w = _bytes(lay.dtype)
    expert_dp = (lay.dp // lay.ep) if lay.use_distributed_optimizer else 1
    s, b, h = lay.seq_length, lay.micro_batch_size, model.hidden_size
    trained = lay.training.trained_experts(e_shard)  # LoRA: the experts are frozen base weights
    return {
        "expert_weights": e_shard * w,
        "expert_grads": trained * grad_b,
        "expert_master_weights": 0.0 if lay.dtype == "fp32" else trained * 4 / expert_dp,
        "expert_optimizer_states": trained * 8 / expert_dp,
        "expert_reference_model": e_shard * w if lay.reference_model else 0.0,
        "moe_dispatch": layer_passes * s * b * model.moe_top_k * (2 * h + 3 * model.moe_ffn_hidden_size / lay.tp) * w,
    }


def kv_cache_bytes(model: ModelDims, roll: RolloutLayout) -> float:
    """M_KV = 2 (K and V) x B x L x H_kv x d x T x bytes, split over the group's TP ranks."""
    return (
        2 * roll.max_num_seqs * model.num_layers * model.num_kv_heads * model.head_dim
        * roll.max_model_len * _bytes(roll.dtype) / roll.tp
    )


def rollout_ledger(model: ModelDims, roll: RolloutLayout, reserve_fraction: float,
                   gpu_memory_gib: float | None = None) -> Ledger:
    """Per-GPU memory of one engine: its need, and with a known budget (gpu_memory_utilization x
    gpu_memory_gib) the whole budget, which vLLM claims at start-up whatever the need."""
    items = {
        "weights": model.num_params / roll.tp * _bytes(roll.dtype),
        "kv_cache": kv_cache_bytes(model, roll),
        "runtime": roll.runtime_gib * GIB,
    }
    items["reserve"] = reserve_fraction * sum(items.values())
    need = sum(items.values())
    budget = None
    if roll.gpu_memory_utilization is not None and gpu_memory_gib is not None:
        budget = roll.gpu_memory_utilization * gpu_memory_gib * GIB
        items["unused_budget"] = max(0.0, budget - need)
    return Ledger(role="rollout", items=items, need=need, budget=budget)


@dataclass(frozen=True, kw_only=True)
class PlacementVerdict:
    placement: str
    gpus_needed: int
    peak_bytes_per_gpu: float
    fits: bool
    largest_item: str
    note: str
    phases: dict[str, float] = field(default_factory=dict)
    """Colocated: bytes per GPU in each phase (rollout, refit, learn); the peak is the largest."""
    startable: bool = True
    """False when the placement cannot start on GPUs whatever its memory (then `fits` is False too)."""
    blocker: str | None = None
    """Why it cannot start, naming the fields (planner/startability.py)."""
    reason: str = ""
    """Why it fits or does not, naming the config keys and the numbers compared (every failed check)."""


def verdict_reason(*, gpus_needed: int, gpus_available: int, peaks: dict[str, float], cap: float,
                   engine_problem: str, blocker: str | None) -> str:
    """Every check a placement fails, naming the config keys; when it fails none, what it fits within.
    peaks: the bytes per GPU of each part that must fit (a role, or a colocated phase)."""
    problems = [blocker] if blocker else []
    if gpus_needed > gpus_available:
        problems.append(f"{gpus_needed} GPUs needed, cluster.gpus is {gpus_available}")
    problems += [f"{what} needs {peak / GIB:.2f} GiB/GPU, more than cluster.gpu_memory_gib {cap / GIB:g}"
                 for what, peak in peaks.items() if peak > cap]
    if engine_problem:
        problems.append(engine_problem)
    if problems:
        return "; ".join(problems)
    return (f"{gpus_needed} GPUs of cluster.gpus {gpus_available}, peak {max(peaks.values()) / GIB:.2f} GiB/GPU within "
            f"cluster.gpu_memory_gib {cap / GIB:g}")


def compare_placements(
    learner: Ledger, rollout: Ledger, lay: LearnerLayout, roll: RolloutLayout,
    gpu_memory_gib: float, gpus_available: int, sleep_mode: bool = True,
) -> list[PlacementVerdict]:
    """Colocated (roles share the same GPUs) vs disaggregated (separate GPUs); see the module doc."""
    cap = gpu_memory_gib * GIB
    engine_ok = rollout.budget is None or rollout.need <= rollout.budget
    engine_problem = "" if engine_ok else (f"the engine needs {rollout.need / GIB:.1f} GiB, more than its "
                                           f"budget {rollout.budget / GIB:.1f} GiB (rollout.gpu_memory_utilization)")
    engine_note = f"; {engine_problem}" if engine_problem else ""
    from megatron_rl.planner.startability import startability_problem  # the start-up rule, on GPUs

    out = []
    dis_gpus = lay.gpus + roll.gpus
    dis_blocker = startability_problem("disaggregated", roll.tp, gpu=True)
    worst = learner if learner.total >= rollout.total else rollout
    out.append(PlacementVerdict(
        placement="disaggregated", gpus_needed=dis_gpus, peak_bytes_per_gpu=worst.total,
        fits=(learner.total <= cap and rollout.total <= cap and dis_gpus <= gpus_available and engine_ok
              and dis_blocker is None),
        largest_item=f"{worst.role}/{worst.largest()}",
        note=f"{lay.gpus} learner + {roll.gpus} rollout GPUs{engine_note}",
        startable=dis_blocker is None, blocker=dis_blocker,
        reason=verdict_reason(gpus_needed=dis_gpus, gpus_available=gpus_available, cap=cap, blocker=dis_blocker,
                              peaks={"the learner": learner.total, "the rollout engine": rollout.total},
                              engine_problem=engine_problem),
    ))
    col_blocker = startability_problem("colocated", roll.tp, gpu=True)
    col_gpus = max(lay.gpus, roll.gpus)
    asleep = roll.runtime_gib * GIB if sleep_mode else rollout.total
    publication = learner.total * (learner.items.get("publish", 0.0) / (learner.total - learner.items["reserve"]))
    phases = {"rollout phase": learner.resident() + rollout.total,
              "refit phase": learner.resident() + publication + rollout.total,
              "learn phase": learner.total - publication + asleep}
    phase = max(phases, key=phases.get)
    merged = {f"learner/{k}": v for k, v in learner.items.items()}
    merged.update({f"rollout/{k}": v for k, v in rollout.items.items()})
    out.append(PlacementVerdict(
        placement="colocated", gpus_needed=col_gpus, peak_bytes_per_gpu=phases[phase],
        fits=phases[phase] <= cap and col_gpus <= gpus_available and engine_ok and col_blocker is None,
        largest_item=max(merged, key=merged.get),
        note=(f"peak in the {phase}; vLLM sleeps while the learner learns" if sleep_mode
              else f"peak in the {phase}; no sleep mode: vLLM keeps its budget while the learner learns")
        + engine_note, phases=phases, startable=col_blocker is None, blocker=col_blocker,
        reason=verdict_reason(gpus_needed=col_gpus, gpus_available=gpus_available, cap=cap, blocker=col_blocker,
                              peaks={f"the {phase}": phases[phase]}, engine_problem=engine_problem),
    ))
    return out


def as_dict(obj) -> dict:
    return dataclasses.asdict(obj)
