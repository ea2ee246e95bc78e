"""RolloutConfig: everything one rollout group (one vLLM engine) needs.

    from megatron_rl.config import load_config
    from megatron_rl.rollout.config import RolloutConfig
    cfg = RolloutConfig(model="/tmp/tiny", tensor_parallel_size=2)

One `RolloutWorker` Ray actor owns one vLLM engine of `tensor_parallel_size` processes;
several actors are data-parallel rollout groups.  vLLM engine options pass through
unchanged in `engine_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rl.platform.cores import parse_cores
from megatron_rl.publish.vllm_adapters import serving_problem

WEIGHT_TRANSFER = ("auto", "gloo", "nccl", "ipc", "none")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
SALTED = "kept (blocks in use; new requests salted apart)"


@dataclass(frozen=True)
class RefitMode:
    """What a refit in one mode does to the requests in flight and to the old weights' KV (module docstring)."""

    pause: str
    """vLLM's pause: "keep" (running requests freeze with their KV) or "wait" (they run to their end first)."""
    invalidate: str
    """The old weights' KV after the load: "recompute" (every kept request is preempted and its KV recomputed),
    "reset" (the prefix cache is emptied when no request holds blocks; the cache salt keeps the rest apart) or
    "none" (blocks are keyed by adapter, and the base never changes)."""
    kept_cache: str = SALTED
    """How the log names a prefix cache that was not emptied."""


REFIT_MODES = {"wait": RefitMode("wait", "reset"), "recompute": RefitMode("keep", "recompute"),
               "keep_kv": RefitMode("keep", "reset"),
               "adapter": RefitMode("keep", "none", "kept (blocks keyed by adapter)")}
"""How a streaming engine refits with requests in flight (rollout/stream_engine.py): rollout.inflight_refit's
values, and "adapter": a LoRA run's, whose base never changes and whose requests each keep the adapter they
started with (vLLM keys cached blocks by adapter), so no KV is invalidated (RolloutConfig.refit_mode)."""
INFLIGHT_REFIT = ("wait", "recompute", "keep_kv")  # what a config may ask for: the modes above but "adapter"


@dataclass(kw_only=True)
class RolloutConfig:
    model: str = ""
    """HF checkpoint directory the engine starts from (version 0); a training or eval run sets it to
    the policy it serves (a training config may not write it)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size of this rollout group."""
    data_parallel_size: int = 1
    """Data-parallel rollout groups of a run (one vLLM engine of tensor_parallel_size each)."""
    max_model_len: int = 1024
    """Longest prompt + response, in tokens."""
    seed: int = 0
    """Engine seed; per-request seeds come from `sampling_seed` + request index."""
    dtype: str = "auto"
    """Model dtype passed to vLLM ("auto" reads config.json; "float32", "bfloat16")."""
    kv_cache_gib: int = 1
    """CPU KV cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE); ignored on GPU."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (GPU only)."""
    temperature: float = 1.0
    """Default sampling temperature; when training, the learner scores with the same one."""
    top_p: float = 1.0
    """Default nucleus sampling threshold (1.0 = off); the learner applies the same mask (the KL
    penalty's reference does not: it is scored untruncated, grpo/loss.py)."""
    top_k: int = 0
    """Default top-k (0 = off; ties at the k-th logit kept); the learner applies the same mask (the
    KL penalty's reference does not)."""
    max_tokens: int = 64
    """Default maximum response length."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs_mode: str = "processed_logprobs"
    """Behaviour logprobs after temperature/top-k/top-p ("processed_logprobs", the
    distribution actually sampled) or of the raw model ("raw_logprobs": training refuses it
    unless temperature is 1 and top-k/top-p are off, where both are the same)."""
    weight_transfer: str = "auto"
    """How new weights arrive, every one checked before commit: "auto" (chosen once at start-up from
    placement and device, publish/transport.py: gloo on CPU, ipc colocated on GPUs, nccl
    disaggregated on GPUs), "gloo" (our buckets over TCP; any placement), "ipc" (CUDA IPC from the
    learner rank on each engine's GPU; colocated only), "nccl" (vLLM's NCCL transfer; disaggregated only) or "none"
    (generation only, no publication).  A standalone engine treats "auto" as "gloo"."""
    sleep_mode: Optional[bool] = None
    """vLLM sleep mode around learning phases (rollout/sleep.py): unset (on when colocated on GPUs in
    sync mode, off otherwise, with the reason logged), true (refused where it cannot work), false."""
    keep_rollback_copy: bool = True
    """Keep a host-memory copy of the serving weights, so that a publication whose load fails on
    one worker after others loaded it is rolled back on all of them (costs one copy of the model
    per worker).  Off: such a group serves nothing until the next publication commits."""
    cpu_threads_bind: str | None = None
    """VLLM_CPU_OMP_THREADS_BIND; None picks rollout.cpu_cores when that is set (TP 1), else "0|1|..." (one core
    per TP rank) when TP > 1 on CPU."""
    cpu_cores: str | None = None
    """The cores the rollout actor and the engine processes it starts run on ("1", "0-1", "0,2-3"), and
    its OpenMP threads' binding unless cpu_threads_bind is set, so that the engines and the learner
    (learner.cpu_cores) do not contend for the same ones (platform/cores.py).  None: any.  TP > 1 needs
    cpu_threads_bind too (one core list per TP rank)."""
    num_cpus: float = 0.0
    """Ray CPUs reserved for the actor (vLLM's own processes are not Ray tasks)."""
    engine_in_process: bool = False
    """Run vLLM's engine core and its one worker inside the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    the "uni" executor) instead of spawning two processes that import torch and vLLM again: ~15-20 s
    less start-up per engine on 2 CPU cores.  A streaming engine then is vLLM's LLMEngine stepped by a
    thread of the actor (rollout/stepped_engine.py) instead of AsyncLLM, whose engine core is always a
    child process with a ZMQ front end in the actor (measured: 0.3 ms of CPU per token less on 2 cores).
    Needs tensor_parallel_size 1.  The tiny CPU recipes set it
    (configs/tiny_cpu*.yaml) and the experiment runner turns it on for its runs (experiment/runner.py);
    the engine drills that kill vLLM's engine-core process turn it off (drill/harness.py ENGINE_PROCESS)."""
    publish_timeout_s: float = 600.0
    """How long a publication waits for a rollout group (both sides: the gloo group's timeout and the
    learner's wait for each group's answer).  A group that does not answer in time is marked stale
    and left out of the publication group until it answers again; then it is refitted (rollout/fleet.py)."""
    generate_timeout_s: float = 1800.0
    """How long the fleet waits for one generate call of a rollout group; past it the group is marked
    stale and unreachable, and the call's requests are sent to a serving group."""
    streaming: bool = False
    """Stream rollouts (rollout/stream_actor.py): each group's vLLM engine is an async engine running many
    prompt groups at once, a group goes to the learner the moment its last sample ends, and publications
    land while requests are in flight (`inflight_refit`).  Off: rounds (one generate call per batch)."""
    inflight_refit: str = "recompute"
    """How a streaming engine takes a publication with requests in flight (rollout/stream_engine.py):
    "recompute" (pause, swap, recompute every kept request's KV under the new weights, resume),
    "keep_kv" (kept requests continue on the KV the old weights computed; recorded per token as its
    kv version) or "wait" (requests in flight finish on the old weights first).  No token is lost in any."""
    adapter: Optional[dict[str, Any]] = None
    """Set by a LoRA run (learner.lora), never by a config: the engines serve each published version as a
    LoRA adapter on the unchanged base (publish/vllm_adapters.py): {"rank", "alpha", "target_modules" (the
    learner's names), "versions" (how many versions' adapters each engine keeps)}.  None: full weights."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Passed through to vllm.LLM as keyword arguments (they win over the fields above)."""

    @property
    def refit_mode(self) -> str:
        """How the streaming engines take a publication with requests in flight, decided here once (the engines
        and the audit's segment labels read it): "adapter" in a LoRA run (each request keeps its own adapter,
        no KV is invalidated), else inflight_refit."""
        return "adapter" if self.adapter is not None else self.inflight_refit

    def run_problem(self, *, placement: str, mode: str) -> str | None:
        """What no device could make work in this section's publication and sleep settings for a run of
        `placement` and `mode` (checked with the run's config, train/config.py; the device's part is chosen
        at start-up, train/placement.py gpu_path_choices); None when they may work."""
        from megatron_rl.publish.transport import placement_problem
        from megatron_rl.rollout.sleep import config_problem

        return (placement_problem(self.weight_transfer, placement)
                or config_problem(placement=placement, mode=mode, requested=self.sleep_mode))

    @classmethod
    def of(cls, config: "RolloutConfig | dict") -> "RolloutConfig":
        """The config itself, or one built from its dict form (as Ray actors receive it), keys checked."""
        from megatron_rl.config import from_dict

        return config if isinstance(config, cls) else from_dict(cls, config)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("publish_timeout_s", "generate_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"rollout.max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"rollout.kv_cache_gib must be >= 1, got {self.kv_cache_gib}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode {self.logprobs_mode!r} is not one of {list(LOGPROBS_MODES)}")
        if self.engine_in_process is not True and self.engine_in_process is not False:
            raise ValueError(f"rollout.engine_in_process must be true or false, got {self.engine_in_process!r}")
        if self.cpu_cores is not None:
            parse_cores(self.cpu_cores, "rollout.cpu_cores")
            if self.tensor_parallel_size > 1 and self.cpu_threads_bind is None:
                raise ValueError(f"rollout.cpu_cores with rollout.tensor_parallel_size {self.tensor_parallel_size} "
                                 "needs rollout.cpu_threads_bind: one core list per TP rank, separated by '|'")
        if self.engine_in_process and self.tensor_parallel_size != 1:
            raise ValueError(f"rollout.engine_in_process needs rollout.tensor_parallel_size 1 (one worker "
                             f"process per rank otherwise), got {self.tensor_parallel_size}: with TP > 1 set "
                             "rollout.engine_in_process=false")
        if self.streaming is not True and self.streaming is not False:
            raise ValueError(f"rollout.streaming must be true or false, got {self.streaming!r}")
        if self.inflight_refit not in INFLIGHT_REFIT:
            raise ValueError(f"rollout.inflight_refit {self.inflight_refit!r} is not one of {list(INFLIGHT_REFIT)}")
        if self.streaming and self.sleep_mode:
            raise ValueError("rollout.sleep_mode: a streaming engine never sleeps (it generates while the learner "
                             "learns); set rollout.sleep_mode false or rollout.streaming false")
        problem = serving_problem(self.adapter, sleep_mode=self.sleep_mode)  # publish/vllm_adapters.py
        if problem:
            raise ValueError(problem)
        if self.weight_transfer not in WEIGHT_TRANSFER:
            raise ValueError(f"rollout.weight_transfer {self.weight_transfer!r} is not one of {list(WEIGHT_TRANSFER)}")
