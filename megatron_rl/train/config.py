"""The root training config: one section per component, each component's own dataclass.

    cfg = load_train_config("configs/tiny_cpu.yaml", ["rollout.top_p=0.9"])
    cfg.sampling   # SamplingConfig the learner scores under: rollout.temperature/top_p/top_k

Sections and their owners:
  model       ModelConfig        (here)                 what policy to start from
  learner     LearnerConfig      megatron_rl.learner     Megatron layout, batch, optimizer
  rollout     RolloutConfig      megatron_rl.rollout     vLLM engine and sampling
  coordinator CoordinatorConfig  megatron_rl.coordinator queue, admission, TTL, WAL
  loss        GRPOLossConfig     megatron_rl.grpo        clipped surrogate, KL, lag guard
  reward      RewardConfig       megatron_rl.reward      verifier and reward components
  data        DataConfig         megatron_rl.data        built-in task, JSONL file, generator; data.env:
                                                             multi-turn episodes (EnvConfig, megatron_rl.envs)
  run         RunConfig          (here)                  mode, steps, placement, checkpoints
  cluster     ClusterConfig      (here)                  what the planner checks against
  stop        StopConfig         megatron_rl.reporting.stop  stop conditions and their exit codes
  dynamic_sampling DynamicSamplingConfig  megatron_rl.sampling.dynamic_sampling  keep only groups whose rewards vary
  audit       AuditConfig        megatron_rl.audit       re-score sequences spanning versions (every N steps)
Shared values are set once and derived: run.prompts_per_step x run.group_size is the learner's
global batch and the coordinator's B, run.mode sets the staleness bound (coordinator/config.py),
the rollout engines serve the policy the run starts from, and the queue log lives in the run
directory.  Writing a derived key, or a key of an earlier version (RENAMED), is a ConfigError
naming what to write instead.  Parallel sizes have one spelling, in the section of the role they
size: learner.{tensor,pipeline,data}_parallel_size, rollout.{tensor,data}_parallel_size.
Cross-section rules are checked in `TrainConfig.__post_init__`, naming both keys.  The learner scores exactly the
distribution the engine samples from: rollout.temperature, top_k and top_p reach it as
`TrainConfig.sampling` (see megatron_rl/learner/logprobs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from megatron_rl.config import ConfigError, apply_overrides, from_dict, read_config_chain
from megatron_rl.data.config import DataConfig
from megatron_rl.audit.config import AuditConfig
from megatron_rl.sampling.dynamic_sampling import DynamicSamplingConfig
from megatron_rl.coordinator.config import CoordinatorConfig, for_run, run_section
from megatron_rl.grpo.loss import GRPOLossConfig
from megatron_rl.learner.config import MIN_TEMPERATURE, LearnerConfig, SamplingConfig, batch_problem
from megatron_rl.reward.math_verifier import RewardConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.reporting.stop import StopConfig


@dataclass(kw_only=True)
class TinyModelSpec:
    """A local random model made on first use (no network), for the built-in task."""

    arch: Literal["llama", "qwen2", "llama3", "qwen3", "qwen3_moe"] = "llama"
    """Model family of the tiny model (llama3: Llama with rope_type llama3; qwen3: q/k norm)."""
    size: str = "tiny"
    """Size preset of `megatron-rl make-tiny-model`."""
    seed: int = 0
    """Seed of its random initialisation."""
    tie_embeddings: bool = False
    """Share the input embedding and the LM head (HF `tie_word_embeddings`, no `lm_head.weight`
    in the checkpoint; Megatron `share_embeddings_and_output_weights`), as Qwen2.5-1.5B and Qwen3-0.6B."""


@dataclass(kw_only=True)
class ModelConfig:
    path: Optional[str] = None
    """Hugging Face model directory (config.json, safetensors, tokenizer) to start from."""
    tiny: Optional[TinyModelSpec] = None
    """Instead of `path`: make a tiny random model inside the run directory."""
    init_from: Optional[str] = None
    """Instead of `path`: another run's directory (e.g. an SFT baseline); starts from its newest
    COMMITTED checkpoint, exported to RUN_DIR/export/step_N of that run."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.path, self.tiny, self.init_from)) != 1:
            raise ConfigError("model: set exactly one of model.path, model.tiny or model.init_from")


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/tiny"
    """Run directory: resolved config, checkpoints, TensorBoard events, metrics.jsonl."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """The staleness bound: sync (on-policy, 0 versions), one_step_off (sample with v while learning
    v+1: 1 version), async (2 versions ahead, or as many as the coordinator section says)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: learner and rollout share devices (take turns); disaggregated: separate devices."""
    steps: int = 100
    """Optimizer steps (= policy versions) to train."""
    prompts_per_step: int = 8
    """Distinct prompts per step."""
    group_size: int = 8
    """G: samples per prompt (the GRPO group).  prompts_per_step x group_size is the batch every
    role works in: the learner's global batch and the coordinator's B are derived from it."""
    eval_every: int = 20
    """Evaluate greedy reward on the held-out split every this many steps (0 = only at start and end)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Keep this many newest COMMITTED checkpoints."""
    resume: bool = True
    """Resume from the newest COMMITTED checkpoint in run.dir if one exists."""
    allow_config_change: bool = False
    """Resume even when keys that shape what the run learns (RESUME_LOCKED: lr, loss, reward, data, sampling)
    differ from the run's config.json (`--allow-config-change`); the changed keys go into run_manifest.json."""
    seed: int = 0
    """Seed of sampling, of the order training visits examples, and of everything random in the driver."""
    deterministic: Optional[bool] = None
    """Deterministic torch algorithms. None: on for CPU processes (with fixed seeds and one thread
    count, CPU runs are reproducible), off on GPUs (there it NaN-fills every allocation and slows
    kernels, while NCCL/TE reductions are not bitwise reproducible anyway); true/false forces it."""
    torch_threads: int = 1
    """Intra-op threads of each learner process (CPU)."""
    use_existing_ray: bool = False
    """Connect to the Ray cluster at RAY_ADDRESS (set by the Slurm script) instead of starting one."""
    ray_num_cpus: Optional[int] = None
    """CPUs a locally started Ray advertises (None: Ray's own count)."""
    publish_bucket_mib: int = 64
    """Size of one checksummed bucket of a weight publication."""
    publish_checksum: Literal["blocksum", "blake3"] = "blocksum"
    """How each bucket is checksummed: "blocksum" (block sums under blake3; fast, on the GPU where the
    tensors lie) or "blake3" (cryptographic over every byte; publish/checksum.py)."""
    take_timeout_s: float = 600.0
    """How long a learner step waits for a full batch inside its version window before failing."""
    learner_timeout_s: float = 1800.0
    """How long one call on the learner ranks (a step, a save, a publication) may take; past it, or as
    soon as a rank dies, the run stops with exit 75 (rerun to resume) instead of hanging."""

    shadow_tolerance: float = 1e-3
    """Resume refuses a checkpoint whose loaded weights give logprobs on its stored probe batch that
    differ from the saved ones by more than this (max |Δ logprob|; train/restart.py)."""
    refit_tolerance: Union[float, Literal["auto"], None] = "auto"
    """Refit check after each publication: a rollout group whose freshly loaded weights give logprobs
    on the probe (tokens the engines sampled) that differ from the learner's by more than this (median
    |Δ| over its tokens) rolls that version back, and the version is published once more. "auto": the
    bound of the serving dtype and the model's depth (0.05 float32; bfloat16 0.08 per layer, measured:
    rollout/refit_check.py); None: no check."""
    canary_lr_scale: float = 1.0
    """Learning-rate scale of the first step after a restart (the canary; its loss and grad norm must
    be finite).  1.0 keeps a resumed run bit-identical to an uninterrupted one; e.g. 0.1 eases back in."""

    def __post_init__(self) -> None:
        if self.refit_tolerance not in (None, "auto") and not self.refit_tolerance > 0:
            raise ConfigError(f"run.refit_tolerance must be > 0, 'auto' or null, got {self.refit_tolerance}")
        if not self.shadow_tolerance >= 0:
            raise ConfigError(f"run.shadow_tolerance must be >= 0, got {self.shadow_tolerance}")
        if not 0 < self.canary_lr_scale <= 1:
            raise ConfigError(f"run.canary_lr_scale must be in (0, 1], got {self.canary_lr_scale}")
        if not self.learner_timeout_s > 0:
            raise ConfigError(f"run.learner_timeout_s must be > 0, got {self.learner_timeout_s}")
        for name in ("steps", "prompts_per_step", "group_size", "publish_bucket_mib"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"run.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.group_size < 2:
            raise ConfigError(f"run.group_size must be >= 2 for group-normalised advantages, got {self.group_size}")


@dataclass(kw_only=True)
class ClusterConfig:
    gpu_memory_gib: float = 80.0
    """Memory of one GPU, for the capacity planner."""
    gpus: int = 8
    """GPUs available to the job, for the capacity planner."""
    reserve_fraction: float = 0.15
    """Share of memory the planner keeps back for fragmentation and caches."""
    gpus_per_node: int = 8
    """GPUs per node, for the planner's host-memory row (learner ranks and engines on one node)."""
    host_memory_gib: Optional[float] = None
    """Host memory of one node: `megatron-rl plan` refuses a recipe whose resume needs more
    (planner/host_memory.py); None: not checked."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ConfigError(f"cluster.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ConfigError(f"cluster.host_memory_gib must be > 0 or null, got {self.host_memory_gib}")


@dataclass(kw_only=True)
class WandbConfig:
    project: Optional[str] = None
    """Weights & Biases project; None: no W&B (TensorBoard and metrics.jsonl only).  Needs `pip install wandb`."""
    entity: Optional[str] = None
    """W&B entity (user or team); None: your default."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online, offline (files under RUN_DIR/wandb, `wandb sync` later) or disabled."""
    name: Optional[str] = None
    """Run name; None: the run directory's name.  A resumed run continues the same W&B run."""


@dataclass(kw_only=True)
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases beside TensorBoard (megatron_rl/tracking.py): the same metric names, the resolved config."""


@dataclass(kw_only=True)
class SFTConfig:
    steps: int = 50
    """Optimizer steps of `megatron-rl sft` (sft.global_batch_size examples each)."""
    lr: Optional[float] = None
    """Learning rate for SFT; None uses learner.lr."""
    global_batch_size: Optional[int] = None
    """Examples per SFT step (a multiple of learner.micro_batch_size); None uses the GRPO batch
    (run.prompts_per_step x run.group_size)."""
    first: bool = False
    """`megatron-rl train` first runs (or resumes) SFT in RUN_DIR/sft and starts GRPO from its result:
    the baseline the run is measured against (its hidden-test correctness, the GRPO run's step-0 eval of the
    same weights, is in the final JSON line).  Both stages share one Ray; the SFT stage starts no engine."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"sft.steps must be >= 1, got {self.steps}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"sft.lr must be > 0, got {self.lr}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"sft.global_batch_size must be >= 1, got {self.global_batch_size}")


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelConfig
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def rollout_served(self) -> RolloutConfig:
        """The rollout section as this run's engines serve it: with learner.lora's adapters as rollout.adapter
        (models/lora_config.py LoraConfig.serving; None for full weights), the newest max_version_lag + 1 kept."""
        return dataclasses.replace(self.rollout,
                                   adapter=self.learner.lora.serving(self.coordinator.max_version_lag + 1))

    @property
    def refit_mode(self) -> str:
        """How this run's streaming engines take a publication in flight (what the offline audit labels a later
        segment with): rollout/config.py RolloutConfig.refit_mode of the rollout they serve."""
        return self.rollout_served.refit_mode

    def __post_init__(self) -> None:
        # Derived, never written: one batch size for the learner and the coordinator, the staleness
        # bound from run.mode (coordinator/config.py owns that rule).
        samples = self.run.prompts_per_step * self.run.group_size
        mbs, dp = self.learner.micro_batch_size, self.learner.data_parallel_size
        problem = batch_problem(samples, mbs, dp)  # learner/config.py: the one batch rule
        if problem:
            raise ConfigError(f"run.prompts_per_step x run.group_size ({self.run.prompts_per_step} x "
                              f"{self.run.group_size}, the learner's global batch): {problem} "
                              "(learner.micro_batch_size x learner.data_parallel_size)")
        self.learner = dataclasses.replace(self.learner, global_batch_size=samples)
        self.coordinator = for_run(self.coordinator, mode=self.run.mode, batch_size=samples)
        # The audit is on by default where a sequence's tokens can span versions (audit/config.py).
        self.audit = self.audit.for_run(spans_versions=self.rollout.streaming
                                        and self.refit_mode in ("recompute", "keep_kv"))
        problem = self.rollout_served.run_problem(placement=self.run.placement, mode=self.run.mode)  # device: later
        if problem:
            raise ConfigError(problem)
        if self.rollout.weight_transfer == "none":
            raise ConfigError("rollout.weight_transfer 'none' cannot train: the policy could never reach the "
                              "rollout engines (use 'gloo', or 'nccl' with run.placement 'disaggregated')")

        sft_batch = self.sft.global_batch_size
        problem = batch_problem(sft_batch, mbs, dp) if sft_batch is not None else None
        if problem:
            raise ConfigError(f"sft.global_batch_size: {problem} (learner.micro_batch_size x "
                              "learner.data_parallel_size)")
        if self.sft.first and self.model.init_from is not None:
            raise ConfigError("sft.first runs SFT and starts GRPO from it, but model.init_from already names the "
                              "policy to start from; set only one")
        if self.stop.dev_eval_drops and not self.run.eval_every:
            raise ConfigError("stop.dev_eval_drops watches the dev eval, but run.eval_every is 0 (no dev evals)")
        self._check_sampling()
        self._check_prompt_room()

    def _check_prompt_room(self) -> None:
        """A prompt must fit the engine's context next to a whole response (data.max_prompt_tokens)."""
        room = self._prompt_room
        if room < 1:
            raise ConfigError(f"rollout.max_tokens ({self.rollout.max_tokens}) leaves no room for a prompt in "
                              f"rollout.max_model_len ({self._context_len}); raise max_model_len or lower max_tokens")
        limit = self.data.max_prompt_tokens
        if limit is not None and limit > room:
            raise ConfigError(f"data.max_prompt_tokens ({limit}) is more than rollout.max_model_len - "
                              f"rollout.max_tokens ({self._context_len} - {self.rollout.max_tokens} = {room}): such a "
                              f"prompt leaves no room for a whole response; set data.max_prompt_tokens <= {room} or "
                              f"leave it unset")

    @property
    def _context_len(self) -> int:
        """The engine's context: rollout.engine_options.max_model_len wins over rollout.max_model_len."""
        return int(self.rollout.engine_options.get("max_model_len", self.rollout.max_model_len))

    @property
    def _prompt_room(self) -> int:
        return self._context_len - self.rollout.max_tokens

    @property
    def prompt_token_limit(self) -> int:
        """Longest prompt a run keeps (megatron_rl/data/prompt_length.py): data.max_prompt_tokens, or
        rollout.max_model_len - rollout.max_tokens when unset."""
        return self.data.max_prompt_tokens or self._prompt_room

    def _check_sampling(self) -> None:
        """The rollout's sampling settings must describe a distribution the learner can score."""
        ro = self.rollout
        if ro.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"rollout.temperature {ro.temperature} is greedy decoding (vLLM treats < "
                              f"{MIN_TEMPERATURE} as argmax): no distribution to learn from; use a temperature > 0")
        self._check_env()
        if "logprobs_mode" in ro.engine_options:
            raise ConfigError("rollout.engine_options.logprobs_mode: set rollout.logprobs_mode instead (the learner "
                              "checks it against the sampling settings)")
        if ro.logprobs_mode == "raw_logprobs" and (ro.temperature != 1 or self.sampling.truncates):
            raise ConfigError(
                f"rollout.logprobs_mode 'raw_logprobs' records the raw model's logprobs, but samples are drawn with "
                f"rollout.temperature={ro.temperature}, top_p={ro.top_p}, top_k={ro.top_k}: the behavior logprobs "
                f"would not be the sampling distribution; use 'processed_logprobs'")

    def _check_env(self) -> None:
        """Multi-turn episodes fit the engine's context (envs/config.py)."""
        env = self.data.env
        if not env.enabled:
            return
        if env.max_total_tokens > self._context_len:
            raise ConfigError(f"data.env.max_total_tokens ({env.max_total_tokens}) is more than "
                              f"rollout.max_model_len ({self._context_len}): an episode could outgrow the engine's context")

    @property
    def sampling(self) -> SamplingConfig:
        """The distribution the rollout engine samples training data from, which the learner scores."""
        return SamplingConfig(temperature=self.rollout.temperature, top_p=self.rollout.top_p, top_k=self.rollout.top_k)

    @property
    def samples_per_step(self) -> int:
        return self.run.prompts_per_step * self.run.group_size


RENAMED = {
    "learner.tensor_model_parallel_size": "learner.tensor_parallel_size",
    "learner.pipeline_model_parallel_size": "learner.pipeline_parallel_size",
    "run.learner_data_parallel_size": "learner.data_parallel_size",
    "run.rollout_groups": "rollout.data_parallel_size",
}
"""Keys of earlier versions: one spelling of parallel sizes, in the section of the role they size."""
DERIVED = {
    "learner.global_batch_size": "it is derived: run.prompts_per_step x run.group_size (SFT's batch is "
                                 "sft.global_batch_size)",
    "rollout.model": "the engines serve the policy the run starts from: set model.path, model.tiny or "
                     "model.init_from",
    "rollout.adapter": "a LoRA run sets it from learner.lora (its engines serve adapters): set learner.lora",
}
"""Keys a training run sets itself (coordinator/config.py lists the coordinator's)."""


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read, override and validate a training config; errors name the dotted key.

    Keys the run derives (DERIVED, coordinator.run_section) and keys of earlier versions (RENAMED)
    are refused, naming what to write instead.
    """
    data = apply_overrides(read_config_chain(Path(path)) if path is not None else {}, list(overrides))
    for dotted, hint in [*((k, f"it was renamed: use {v}") for k, v in RENAMED.items()), *DERIVED.items()]:
        section, key = dotted.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(f"{dotted} cannot be set: {hint}")
    run = data.get("run") if isinstance(data.get("run"), dict) else {}
    data["coordinator"] = run_section(data.get("coordinator", {}), mode=run.get("mode", RunConfig.mode))
    return from_dict(TrainConfig, data)


def resolved_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def data_order_seed(cfg: TrainConfig) -> int:
    """Seed of the training data order: the split (data.seed) and the run (run.seed) both count."""
    return cfg.data.seed * 1_000_003 + cfg.run.seed
