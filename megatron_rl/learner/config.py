"""LearnerConfig: the learner's section of the run config (Megatron's names for Megatron's knobs).
SamplingConfig: the distribution the rollout engine samples from, which the learner scores.

    cfg = LearnerConfig(tensor_parallel_size=2, global_batch_size=16, lr=1e-6)
    cfg = LearnerConfig(lora=LoraConfig(enabled=True, rank=8), ...)   # adapters only (models/lora.py)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)   # the rollout's numbers
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from megatron_rl.models.lora_config import LoraConfig
from megatron_rl.platform.cores import parse_cores


def uses_sequence_parallel(moe: bool, tp: int) -> bool:
    """Megatron trains MoE layers at TP > 1 only with sequence parallelism (MoELayer refuses otherwise);
    dense models keep plain TP.  The learner and the planner's ledger both follow this rule."""
    return moe and tp > 1


def world_size(tp: int, pp: int, dp: int) -> int:
    """The learner's rank count: tensor x pipeline x data parallel (expert parallelism lies within them).
    The one place this product is taken (LearnerConfig.world_size, the planner's layout, resume checks)."""
    return tp * pp * dp


def batch_problem(batch: int, micro_batch_size: int, dp: int = 1) -> str | None:
    """The one batch rule: a global batch splits into whole micro-batches of `micro_batch_size` rows on each
    of `dp` data-parallel ranks.  None when `batch` does, else what is wrong (callers name their fields)."""
    if batch % (micro_batch_size * dp):
        split = f"micro_batch_size x dp = {micro_batch_size} x {dp}" if dp > 1 else f"micro_batch_size {micro_batch_size}"
        return f"{batch} is not a multiple of {split}"
    return None


@dataclasses.dataclass(kw_only=True)
class LearnerConfig:
    """Parallel layout, batch shape, optimizer and LR schedule of the Megatron learner."""

    tensor_parallel_size: int = 1
    """TP: ranks sharing each layer's matrices (Megatron's tensor_model_parallel_size)."""
    pipeline_parallel_size: int = 1
    """PP: ranks holding consecutive blocks of layers (Megatron's pipeline_model_parallel_size)."""
    data_parallel_size: int = 1
    """DP: learner replicas; learner ranks = TP x PP x DP."""
    expert_parallel_size: int = 1
    """EP (MoE models): data-parallel ranks splitting each layer's experts; must divide DP
    (Megatron's expert_model_parallel_size)."""
    moe_routing_replay: bool = False
    """MoE models: build the routers with Megatron's routing replay, so a forward pass can be given the
    experts the rollout engine routed each token to (megatron_rl.models.routing.replay_routing)."""
    micro_batch_size: int = 1
    """Sequences per forward/backward pass on one rank."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step across all data-parallel ranks.  None: derived by the run
    (GRPO: run.prompts_per_step x run.group_size; SFT: sft.global_batch_size); a Learner needs it set."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of a micro-batch (rows x the micro-batch's own longest row, padding included).
    Set: every learner pass (training, logprobs, SFT) sorts the batch's rows by length, deals them
    to data-parallel ranks with balanced token counts, packs each rank's rows into micro-batches
    within this budget (a longer row runs alone) and pads each micro-batch only to its own
    longest row; micro_batch_size is then unused.  None or 0 (off, as top_k 0 and clip_grad 0 are):
    fixed micro-batches of micro_batch_size rows, all padded to the batch's longest
    (megatron_rl.learner.micro_batches); `train --dry-run` says which (learner.micro_batches)."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps of decay after warmup; None keeps lr constant."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (ZeRO-1)."""
    seed: int = 1234
    """Seed of model init and of the model-parallel RNG tracker."""
    dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    """Model dtype; None takes the platform default (bf16 on GPUs, fp32 on CPU)."""
    recompute_activations: bool = False
    """Full activation recomputation per layer (saves memory, costs a forward)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters beside the linear layers of a frozen base (megatron_rl.models.lora)."""
    cpu_cores: Optional[str] = None
    """The cores every learner rank's process runs on ("0", "0-1", "0,2-3"), so that the learner and
    the rollout engines (rollout.cpu_cores) do not contend for the same ones (platform/cores.py).  None: any."""

    @property
    def world_size(self) -> int:
        """Ranks of the learner: tensor x pipeline x data parallel (expert parallelism lies within them)."""
        return world_size(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size",
                     "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if name == "global_batch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"learner.{name} must be a positive integer, got {value!r}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"learner.max_tokens_per_micro_batch must be an integer >= 1 (a token budget), or 0 or "
                             f"null (off: fixed micro-batches of micro_batch_size rows), got {budget!r}")
        problem = batch_problem(self.global_batch_size, self.micro_batch_size) if self.global_batch_size else None
        if problem:
            raise ValueError(f"learner.global_batch_size {problem}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"learner.lr must be > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("weight_decay", "clip_grad", "adam_eps", "lr_warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"learner.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"learner.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(f"learner.lr_decay_steps must be >= 1 or null, got {self.lr_decay_steps!r}")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"learner.lr_decay_style must be constant|linear|cosine, got {self.lr_decay_style!r}")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"learner.lr_decay_style={self.lr_decay_style!r} needs learner.lr_decay_steps")
        if self.cpu_cores is not None:
            parse_cores(self.cpu_cores, "learner.cpu_cores")

    def micro_batching(self) -> str:
        """How a batch is cut into micro-batches, in words (what 0 and null mean included)."""
        if self.max_tokens_per_micro_batch:
            return (f"token budget: length-sorted micro-batches of at most {self.max_tokens_per_micro_batch} tokens "
                    f"(learner.max_tokens_per_micro_batch), each padded to its own longest row")
        return (f"fixed: {self.micro_batch_size} rows (learner.micro_batch_size) padded to the batch's longest row; "
                f"learner.max_tokens_per_micro_batch {'null' if self.max_tokens_per_micro_batch is None else 0} "
                f"means off")


MIN_TEMPERATURE = 1e-5
"""Below this temperature vLLM decodes greedily (its _SAMPLING_EPS): there is no distribution to score."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The sampling distribution the learner scores: temperature, then top-k, then top-p (vLLM's order).

    Not a section of the run config: it is built from the rollout section's numbers
    (`TrainConfig.sampling`), so the learner always scores what the engine sampled.
    """

    temperature: float = 1.0
    """Logits are divided by this before the softmax (> 0; greedy decoding is not a distribution)."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]; 1.0 keeps the whole vocabulary."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th value kept); 0 keeps the whole vocabulary."""

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(f"sampling.temperature must be >= {MIN_TEMPERATURE} (below it vLLM decodes greedily "
                             f"and there is no distribution to score), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def untruncated(self) -> "SamplingConfig":
        """The same temperature with top-k and top-p off: the distribution the frozen reference is
        scored under, so that the KL penalty's pi_ref gives every token a probability (see
        megatron_rl/grpo/loss.py, "Reference KL under a truncating sampler")."""
        return SamplingConfig(temperature=self.temperature)

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p removes tokens (the learner then needs the whole vocabulary row)."""
        return self.top_p < 1 or self.top_k > 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
