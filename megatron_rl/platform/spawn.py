"""Run a function on N CPU gloo processes and collect what each returns (tests, tools).

    def work(rank, world_size, tp):
        with parallel_scope(tp=tp):
            return build_and_run(...)          # picklable; tensors come back on CPU
    results = run_distributed(work, 4, 2)  # [rank0_result, ..., rank3_result]

`fn` must be importable by the children (a module-level function), as with any spawn start.
Rank 0 opens the rendezvous on a port the OS picks while binding and tells the others which (no
port is chosen first and bound later, when a process beside it may have taken it); each child gets
torch.distributed on gloo, the CPU compatibility layer, and one intra-op thread (the machine has few
cores and several ranks share them).  A child's exception is re-raised in the parent as
`DistributedChildError` carrying its traceback text.

CPU ranks are forked from a forkserver that imported torch and Megatron-Core once (`_PRELOAD`), not
started as fresh Pythons that each import them (~6 s of CPU a rank here); the server lives as long as
the calling process, and each child takes the caller's environment of the moment.  GPU ranks are
spawned: nothing of CUDA or Transformer Engine is loaded before a rank picks its device.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import torch

logger = logging.getLogger(__name__)


class DistributedChildError(RuntimeError):
    """A rank failed inside run_distributed; the message holds the child's traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (for a rendezvous about to be opened)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


_STORE_TIMEOUT_S = 600.0


def loopback_store(world_size: int, port: int | None = None):
    """This process's end of a rendezvous on loopback: the store rank 0 listens with (`port` None: on one the
    OS picks while binding, so no other process can take it first; `store.port` says which), or a client of
    the one at `port`.  Gloo is pinned to loopback and MASTER_ADDR / MASTER_PORT are set for later readers."""
    from megatron_rl.platform.listen import LOOPBACK, joining_store, listening_store, pin_gloo

    pin_gloo(LOOPBACK)
    if port is None:
        store = listening_store(LOOPBACK, world_size, _STORE_TIMEOUT_S)
    else:
        store = joining_store(LOOPBACK, port, world_size, _STORE_TIMEOUT_S)
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(store.port))
    return store


def _rendezvous(rank: int, world_size: int, port_box, opened, wait_s: float):
    """Rank 0 opens the store and writes its port in `port_box` (then sets `opened`); the others wait for it
    and join."""
    if rank == 0:
        store = loopback_store(world_size)
        port_box.value = store.port
        opened.set()
        return store
    if not opened.wait(wait_s):
        raise TimeoutError(f"rank 0 did not open the rendezvous within {wait_s:.0f}s")
    return loopback_store(world_size, port_box.value)


# What a CPU rank's forkserver imports before it forks (what every rank's work builds on).
_PRELOAD = [
    "megatron_rl.platform.spawn",
    "megatron_rl.platform.parallel",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
]


def _start_context(device: str):
    if device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: once per calling process
    return ctx


def _child(fn, rank: int, world_size: int, rendezvous: tuple, args: tuple, results, device: str,
           environ: dict | None = None) -> None:
    if environ is not None:  # a forked rank: the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    if device == "cpu":
        # A CPU-forced child hides the GPUs before anything initialises CUDA (TE, vLLM, Megatron).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from megatron_rl.platform import detect_platform
        from megatron_rl.platform.parallel import init_distributed

        store = _rendezvous(rank, world_size, *rendezvous)
        init_distributed(detect_platform(device), rank=rank, world_size=world_size, store=store)
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(_to_cpu(value), buf)  # bytes, not shared-memory tensors: the child may exit first
        results.put((rank, True, buf.getvalue()))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything (incl. SystemExit) to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def run_distributed(fn, world_size: int, *args, timeout: float = 300, device: str = "cpu") -> list:
    """Spawn `world_size` ranks running fn(rank, world_size, *args); return their results.

    device="cpu" (default): gloo + CPU compat.  device="cuda": NCCL, rank r on GPU r (GPU tests).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _start_context(device)
    results = ctx.Queue()
    rendezvous = (ctx.Value("i", 0), ctx.Event(), timeout)
    environ = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, rendezvous, args, results, device, environ),
                         daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not any(i in collected for i, _ in dead):
                    # give a failing child's report a moment to arrive before blaming the exit code
                    time.sleep(1.0)
                    if results.empty():
                        raise DistributedChildError(f"rank {dead[0][0]} exited with code {dead[0][1]} without a report")
                    continue
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise TimeoutError(f"run_distributed({fn.__name__}) timed out after {timeout}s; ranks {missing} did not finish")
                continue
            if not ok:
                raise DistributedChildError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        results.close()
    return [collected[r] for r in range(world_size)]
