"""Process group and Megatron parallel-state lifecycle.

    platform = detect_platform()
    init_distributed(platform)                    # env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    with parallel_scope(tp=2, pp=1, seed=1234):   # Megatron groups + model-parallel RNG
        model = build_gpt_model(...)
    # groups destroyed here; another layout may follow in the same processes

Group lifetime: Megatron's destroy_model_parallel() only drops its references to most groups (it
destroys a few gloo ones), while torch keeps every `dist.new_group` alive in its registry, so a
process that re-initialises (the engine pool's learner rebuilds) would pile up NCCL communicators
(GPU) or gloo sockets/threads (CPU).  initialize_parallel therefore snapshots the registry of live
groups, and destroy_parallel destroys every group registered since that snapshot and still live:
Megatron's groups and any made later for the learner's use.  The default (world) group and groups that
existed before initialize_parallel are kept.  A module that caches such a group
(publish/ipc_route.py's subgroups) registers a `register_teardown` callback that forgets it.
The CPU path enables `cpu_compat` first (also on a machine with GPUs: a CPU-forced process keeps
Megatron's CUDA calls on the CPU), so the same calls work on gloo without a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random

import torch
import torch.distributed as dist

from megatron_rl.platform import Platform

logger = logging.getLogger(__name__)

# The live groups before initialize_parallel (None: no parallel state set up by initialize_parallel).
_GROUPS_BEFORE: set | None = None
_TEARDOWN: list = []  # callbacks run by destroy_parallel after the groups are destroyed


def register_teardown(callback) -> None:
    """Have destroy_parallel call `callback()` (e.g. to forget a cached subgroup it destroyed)."""
    if callback not in _TEARDOWN:
        _TEARDOWN.append(callback)


def _group_registry() -> dict:
    """torch's registry of live process groups (private: `distributed_c10d._world.pg_map`).

    Read rather than guessed: if a torch release moves it, fail loudly instead of leaking groups.
    """
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if not isinstance(registry, dict):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d._world.pg_map; "
            "megatron_rl.platform.parallel needs it to destroy the process groups it created "
            "(update _group_registry for this torch version)")
    return registry


def group_is_live(group) -> bool:
    """Whether `group` is still a registered (not destroyed) process group."""
    return group is not None and group in _group_registry()


def live_group_count() -> int:
    """How many process groups torch holds (the default group included)."""
    return len(_group_registry())


def _destroy_groups_since(before: set) -> int:
    """Destroy the live groups not in `before`, newest first (as torch tears down the world:
    every rank creates them in the same order, so every rank destroys them in the same order)."""
    added = [pg for pg in _group_registry() if pg not in before and pg is not dist.GroupMember.WORLD]
    for pg in reversed(added):
        dist.destroy_process_group(pg)
    return len(added)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"environment variable {name} is not set (needed for init_distributed)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(
    platform: Platform, rank: int | None = None, world_size: int | None = None, timeout_s: float = 600,
    store: dist.Store | None = None,
) -> None:
    """Initialise torch.distributed on `platform.backend` (no-op when already initialised).

    rank / world_size default to env RANK / WORLD_SIZE.  The rendezvous is `store` when given (every
    rank must then pass one: rank 0 the TCPStore it already listens on, the others a client of it;
    ranks/build.py), else MASTER_ADDR / MASTER_PORT from the environment: rank 0 listens there
    on MASTER_ADDR alone (not on every interface, as env:// would: platform/listen.py).
    """
    if platform.is_cpu:
        from megatron_rl.platform.cpu_compat import enable_cpu_compat

        # The CPU path was asked for: redirect Megatron's CUDA calls even where CUDA is visible,
        # or its buffers (torch.cuda.current_device()) would land on a GPU next to CPU weights.
        enable_cpu_compat(force=True)
    if dist.is_initialized():
        return
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    for name in ("MASTER_ADDR", "MASTER_PORT") if store is None else ():
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (needed for init_distributed)")
    if store is None:
        store = _env_store(rank, world_size, timeout_s)
    if platform.device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=platform.backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        store=store,
    )
    logger.info("torch.distributed up: rank %d/%d on %s", rank, world_size, platform.backend)


def _env_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The rendezvous at MASTER_ADDR:MASTER_PORT: rank 0 listens on that address alone, the others join it."""
    from megatron_rl.platform.listen import joining_store, listening_store, pin_gloo

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    pin_gloo(host)
    if rank == 0:
        return listening_store(host, world_size, timeout_s, port=port)
    return joining_store(host, port, world_size, timeout_s)


def initialize_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1) -> None:
    """Create Megatron's TP/PP/DP (and MoE expert-parallel) groups and seed the model-parallel RNG tracker.

    DP is world_size / (tp * pp); ep (expert parallel, MoE only) splits the experts over ep ranks of
    the DP dimension (expert TP = tp).  Seeding matches Megatron's training scripts: python, torch
    and the tracker get `seed + 100 * pp_rank` so pipeline stages draw different initial weights.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("initialize_parallel needs torch.distributed; call init_distributed first")
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call destroy_parallel first")
    if ep < 1 or (world // (tp * pp)) % ep:
        raise ValueError(f"data parallel size {world // (tp * pp)} is not a multiple of expert parallel size {ep}")
    global _GROUPS_BEFORE
    _GROUPS_BEFORE = set(_group_registry())
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and global buffers (torch.distributed itself stays up).

    Every process group created since initialize_parallel is destroyed too (see the module
    docstring); Megatron's destroy runs first, and the gloo groups it already destroyed are no
    longer registered, so none is destroyed twice.  Every rank must call this (as it must create).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    global _GROUPS_BEFORE
    ps.destroy_model_parallel()
    if _GROUPS_BEFORE is not None and dist.is_initialized():
        count = _destroy_groups_since(_GROUPS_BEFORE)
        logger.debug("destroyed %d process groups made since initialize_parallel", count)
    _GROUPS_BEFORE = None
    for callback in _TEARDOWN:
        callback()
    mrandom.get_cuda_rng_tracker().reset()
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    destroy_num_microbatches_calculator()


@contextlib.contextmanager
def parallel_scope(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1):
    """initialize_parallel(tp, pp, seed, ep) for the block; always destroy_parallel() afterwards."""
    initialize_parallel(tp=tp, pp=pp, seed=seed, ep=ep)
    try:
        yield
    finally:
        destroy_parallel()
