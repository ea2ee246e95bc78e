"""How a rollout actor starts its vLLM engine: environment, LLM arguments, priority, EOS ids.

    from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs
    os.environ.update(engine_env(cfg, on_gpu=False))
    llm = vllm.LLM(**llm_kwargs(cfg, on_gpu=False))

Used by rollout/worker.py (RolloutWorker.__init__); kept apart so the choices can be read and
tested without starting an engine (tests/unit/test_gpu_path_choices.py).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from megatron_rl.platform.cores import confine_process, format_cores, parse_cores
from megatron_rl.platform.priority import RAY_ACTOR_ENV
from megatron_rl.publish.vllm_adapters import adapter_engine_options, kept_base
from megatron_rl.rollout.config import RolloutConfig

log = logging.getLogger(__name__)


def transfer_path(cfg: RolloutConfig):
    """The publication path this engine receives (publish/transports.py); "none" has no path and
    takes gloo's engine side (which nothing will ever connect to)."""
    from megatron_rl.publish.transport import transport_class

    return transport_class("auto" if cfg.weight_transfer == "none" else cfg.weight_transfer)


def runs_eager(cfg: RolloutConfig, on_gpu: bool) -> bool:
    """vLLM's enforce_eager for this engine: on CPU (no CUDA graphs to capture), unless engine_options say."""
    return bool(cfg.engine_options.get("enforce_eager", not on_gpu))


def engine_env(cfg: RolloutConfig, on_gpu: bool) -> dict[str, str]:
    """Environment variables vLLM needs for this config (on GPU only the in-process switch)."""
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if cfg.engine_in_process else {}
    if on_gpu:
        # The ipc backend's handles travel pickled (vLLM refuses to unpickle them otherwise).
        return {**in_process, **transfer_path(cfg).engine_env}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), **in_process}
    if runs_eager(cfg, on_gpu):
        # An eager CPU engine still traces the one torch.compile'd op of its sampler (the rank of each sampled
        # token's logprob) at its first call: 2.7 s of dynamo tracing per engine start here, for an op a
        # reduction does eagerly.  Read when vLLM's sampler is imported (after this), and by its processes.
        env["TORCHDYNAMO_DISABLE"] = "1"
    bind = cfg.cpu_threads_bind
    if bind is None and cfg.cpu_cores is not None:  # TP 1 (config check): its one worker's threads on the cores
        bind = format_cores(parse_cores(cfg.cpu_cores, "rollout.cpu_cores"))
    if bind is None and cfg.tensor_parallel_size > 1:
        # vLLM's "auto" binding wants one NUMA node per TP rank; give each rank one core.
        ncpu = os.cpu_count() or 1
        bind = "|".join(str(r % ncpu) for r in range(cfg.tensor_parallel_size))
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env


def llm_kwargs(cfg: RolloutConfig, on_gpu: bool) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM built from the config (engine_options win)."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_model_len=cfg.max_model_len,
        seed=cfg.seed,
        dtype=cfg.dtype,
        skip_tokenizer_init=True,
        enforce_eager=runs_eager(cfg, on_gpu),
        logprobs_mode=cfg.logprobs_mode,
        distributed_executor_backend="uni" if cfg.engine_in_process else "mp",
    )
    if on_gpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:
        # A prompt prefilled over two engine steps (chunked prefill: a batch of more prompt tokens than one step
        # takes, or a request resumed after a refit's preemption) makes vLLM's CPU runner rewind its seeded
        # sampler, which a CPU torch.Generator cannot ("CPU Generator does not use offset"): the engine dies.
        kwargs["enable_chunked_prefill"] = False
    # Importing the extension in each vLLM worker registers the gloo backend there and
    # requests AMX permission (spawned CPU workers die with SIGILL without it).
    kwargs["worker_extension_cls"] = "megatron_rl.publish.vllm_engine.PublicationWorkerExtension"
    if cfg.weight_transfer != "none":  # "auto" reaches a standalone engine only: gloo
        kwargs["weight_transfer_config"] = {"backend": transfer_path(cfg).vllm_backend}
    if cfg.sleep_mode:  # resolved at start-up (rollout/sleep.py); unset here means off
        kwargs["enable_sleep_mode"] = True
    kwargs.update(adapter_engine_options(cfg.adapter))  # a LoRA run: versions are adapters
    kwargs.update(cfg.engine_options)
    return kwargs


def prepare_actor(cfg: RolloutConfig) -> None:
    """A rollout actor's process before its engine starts: worker logging, normal priority, gloo's sockets
    where the run listens, and our weight-transfer backends registered with vLLM here too
    (publish/vllm_engine.py)."""
    from megatron_rl.console import configure_worker_logging
    from megatron_rl.platform.listen import bind_address, pin_gloo

    configure_worker_logging()
    undo_ray_niceness()
    # vLLM's own gloo groups and the publication group's: loopback when the run is on one node (not the
    # address the host name resolves to), this node's cluster address otherwise; vLLM's processes inherit it.
    pin_gloo(bind_address())
    if cfg.cpu_cores is not None:  # before vLLM starts: the processes and threads it starts inherit them
        field = "rollout.cpu_cores"
        confine_process(parse_cores(cfg.cpu_cores, field), os.sched_getaffinity(0), field)
    if cfg.weight_transfer != "none":
        import megatron_rl.publish.vllm_engine  # noqa: F401


def undo_ray_niceness() -> None:
    """In a Ray actor, reset a raised nice value before vLLM spawns its processes.

    Generation is the whole job of this actor, so it runs at normal priority, like vLLM
    started by hand (platform/priority.py says why).  For this thread only (Linux nice is per thread): it is the one that starts vLLM's
    processes and threads, which inherit it.  Lowering nice needs CAP_SYS_NICE; without
    it, only RAY_ACTOR_ENV in the actor's runtime_env (create_rollout_worker) helps.
    """
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return  # not a Ray actor: the caller chose this priority
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        log.warning("rollout actor runs at nice %d and may not lower it: vLLM loses the CPU to every "
                    "normal-priority process; start it with runtime_env={'env_vars': %s}", nice, RAY_ACTOR_ENV)


def eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json, else config.json (int or list), else []."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


MODEL_FIELDS_IGNORED = ("_name_or_path", "transformers_version")


def engine_identity(cfg: RolloutConfig, on_gpu: bool) -> dict[str, Any]:
    """What an engine started for `cfg` is made of, besides the weights it serves: the LLM arguments
    (the model path left out), its environment, and the model's shapes (config.json).  Two configs
    with the same identity can share one engine, refitted with the other run's weights
    (train/engine_pool.py); sampling defaults, EOS ids and timeouts are not part of it."""
    model_json = os.path.join(cfg.model, "config.json")
    shapes: dict[str, Any] = {}
    if os.path.isfile(model_json):
        with open(model_json) as f:
            shapes = {k: v for k, v in json.load(f).items() if k not in MODEL_FIELDS_IGNORED}
    args = {k: v for k, v in llm_kwargs(cfg, on_gpu).items() if k != "model"}
    # A streaming group is another actor (rollout/stream_actor.py) around another engine (vLLM's async one).
    # A LoRA run's engine keeps the base it loaded (only adapters are published): the base must be the same.
    return {"llm": args, "env": engine_env(cfg, on_gpu), "model": shapes, "num_cpus": cfg.num_cpus,
            "cpu_cores": cfg.cpu_cores, "streaming": cfg.streaming,
            "lora_base": kept_base(cfg.adapter, cfg.model)}


def watched(llm, call):
    """`call()` (it waits for the outputs of vllm.LLM `llm`), raising vLLM's EngineDeadError if the
    engine-core process dies meanwhile.  vLLM's synchronous client marks the engine dead and stops its
    output thread without waking a caller that waits for outputs, so the call would wait forever."""
    import threading

    client = llm.llm_engine.engine_core
    resources, outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
    if resources is None or outputs is None:  # an in-process engine: its errors raise directly
        return call()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if resources.engine_dead:
                from vllm.v1.engine.exceptions import EngineDeadError

                log.error("the vLLM engine-core process of this rollout group died")
                outputs.put_nowait(EngineDeadError())
                return

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    try:
        return call()
    finally:
        done.set()
