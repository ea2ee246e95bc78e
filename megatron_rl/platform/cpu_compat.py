"""Let Megatron-Core 0.16.1 run on a CPU-only torch (gloo), for tests and development.

    from megatron_rl.platform.cpu_compat import enable_cpu_compat
    enable_cpu_compat()          # once per process, before building Megatron objects

Megatron-Core is written for GPUs and reaches for CUDA in four ways on the paths we use
(GPTModel forward/backward, pipeline schedules, DDP, optimizers incl. the distributed
optimizer and gradient clipping).  Each is redirected here, and nothing else:

1. `torch.cuda.current_device()` used as the device of new tensors (buffers of DDP, the
   distributed optimizer, the pipeline's p2p tensors, ...).  -> returns 0, and (2) maps
   device 0 to the CPU.
2. Device literals: `device="cuda"` (default causal mask, token counters in the schedules,
   grad-norm buffers), `tensor.cuda()`, `tensor.to("cuda")`.  These are spread over hundreds
   of call sites, so instead of patching each one a TorchFunctionMode rewrites any CUDA device
   argument of a torch call to "cpu".  The mode is pushed once per calling thread and left
   there (autograd runs CPU backward on the calling thread).
3. Type-string checks such as `param.grad.type() == 'torch.cuda.FloatTensor'` (grad clipping,
   Float16/distributed optimizer param grouping).  The same mode answers a zero-argument
   `Tensor.type()` with the CUDA spelling ('torch.cuda.FloatTensor') for CPU tensors, which
   is what those checks mean ("a float32 tensor on the compute device").
4. The CUDA RNG: `torch.cuda.get_rng_state/set_rng_state/manual_seed` and Megatron's
   `_get_cuda_rng_state/_set_cuda_rng_state` behind the model-parallel RNG tracker.  -> the
   CPU default generator, which is the generator CPU kernels actually draw from, so the
   tracker's fork() really switches the stream used by dropout / init on this device.
   Plus `torch.cuda.synchronize()` -> no-op (CPU ops are synchronous).
5. MoE router gating without Transformer Engine: `moe_utils.RouterGatingLinearFunction` tests
   `te_general_gemm is not None`, but that name is only bound when TE imports, so without TE
   (always, on CPU) every MoE forward raises NameError.  -> the name is bound to None, which
   selects Megatron's own torch.mm path (the TE import failing is exactly that case).
6. Backward passes: a TorchFunctionMode is disabled while its own handler runs, and
   `torch.autograd.backward` reaches the mode, so every backward would run without (2).  The
   MoE all-gather dispatcher's backward allocates on `torch.cuda.current_device()` (expert
   parallel > 1).  -> `torch.autograd.backward` (what Megatron's schedules call without pipeline
   parallelism) runs its body inside a fresh instance of the mode.
7. Sequence parallelism with torch norms: without Apex or TE (always, on CPU) every norm is a
   `WrappedTorchNorm`, which asserts `not config.sequence_parallel`.  A norm over the hidden dim
   is per token, so on a sequence shard it computes the same rows; what sequence parallelism
   needs of it is its weight marked `sequence_parallel`, so that finalize_model_grads sums that
   grad over the TP ranks (each saw only its shard of the sequence), as Apex's FusedLayerNorm
   and TE's norms do.  Megatron trains MoE at TP > 1 only sequence parallel.  -> the norm is
   built from a copy of the config with the flag cleared and its parameters are then marked.

`enable_cpu_compat()` does nothing when CUDA is available, unless forced: init_distributed forces
it for a CPU platform (CPU-forced work on a GPU machine: `convert verify`, the gloo process
tests), whose Megatron buffers would otherwise land on the GPU.  It is idempotent.  Everything it
changes is recorded in `redirect_counts()` so tests can assert what was redirected.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_STATE = {"enabled": False}
_THREAD = threading.local()  # torch function modes are per thread: which threads have ours
_COUNTS: collections.Counter = collections.Counter()

# Zero-argument Tensor.type() spelled as on a GPU, for the Megatron type-string checks (3).
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(dev) -> bool:
    """True for every way torch spells a CUDA device: "cuda", "cuda:1", torch.device, int index."""
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    # A bare int index means a CUDA ordinal to torch (e.g. torch.cuda.current_device()).
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and answers Tensor.type() with CUDA names (2, 3)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward:
            _COUNTS["backward"] += 1
            return _backward_in_mode(*args, **kwargs)
        if func is torch.Tensor.cuda:
            # tensor.cuda(device=None, non_blocking=False, memory_format=...) -> stays on CPU.
            _COUNTS["tensor.cuda"] += 1
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None and args[0].device.type == "cpu":
                _COUNTS["tensor.type"] += 1
                return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            _COUNTS["device_kwarg"] += 1
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            # tensor.to("cuda"), tensor.to(torch.device("cuda"), dtype), tensor.to(0)
            args = tuple(
                "cpu" if i == 1 and not isinstance(a, (torch.dtype, torch.Tensor)) and _is_cuda_device(a) else a
                for i, a in enumerate(args)
            )
        return func(*args, **kwargs)


def _backward_in_mode(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """(6) torch.autograd.backward with the mode on: a mode is off while its own handler runs, and
    calling backward again from the handler would dispatch to the mode again.  So this does what
    backward's body does (torch 2.10: grads made, then the engine run; as Megatron's
    custom_backward does) inside a fresh instance of the mode."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    with _CudaToCpuMode():
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.default_generator.get_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.default_generator.set_state(new_state)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _patch_cuda_runtime() -> None:
    """(1) current_device, (4) RNG and synchronize: the CUDA runtime calls Megatron makes."""

    def current_device() -> int:
        _COUNTS["current_device"] += 1
        return 0

    def synchronize(device=None) -> None:
        _COUNTS["synchronize"] += 1

    torch.cuda.current_device = current_device
    torch.cuda.synchronize = synchronize
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    _bind_missing_te_gemm()
    _allow_sequence_parallel_torch_norm()


def _bind_missing_te_gemm() -> None:
    """(5) Give moe_utils the `te_general_gemm = None` its TE-less import forgets to define."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _COUNTS["moe_te_general_gemm"] += 1


def _allow_sequence_parallel_torch_norm() -> None:
    """(7) WrappedTorchNorm under sequence parallelism: build it without the flag, mark its weights."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm.__new__, "_megatron_rl_sp", False):
        return
    original = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, hidden_size, *args, **kwargs)
        _COUNTS["sequence_parallel_norm"] += 1
        plain = copy.copy(config)  # not dataclasses.replace: that would run the 1,900-line __post_init__
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._megatron_rl_sp = True
    WrappedTorchNorm.__new__ = staticmethod(new)


def enable_cpu_compat(force: bool = False) -> bool:
    """Install the CPU redirections for this process; returns True when they are active.

    No-op (returns False) when CUDA is available, unless `force` (a process that chose the CPU
    path: init_distributed with a CPU platform, and tests).
    The runtime patches are process-wide; the device-mapping mode is per thread (torch keeps
    function modes in thread-local state), so a thread that runs Megatron code other than the
    one that first called this (e.g. a threaded Ray actor) calls it again: it is cheap.
    """
    with _LOCK:
        if not _STATE["enabled"]:
            if torch.cuda.is_available() and not force:
                return False
            _patch_cuda_runtime()
            _STATE["enabled"] = True
            logger.info("Megatron-Core CPU compatibility enabled (CUDA devices -> cpu, CUDA RNG -> CPU RNG)")
    if getattr(_THREAD, "mode", None) is None:
        _THREAD.mode = _CudaToCpuMode()
        _THREAD.mode.__enter__()  # stays pushed for the life of this thread
    return True


def is_enabled() -> bool:
    return _STATE["enabled"]


def redirect_counts() -> dict[str, int]:
    """How many CUDA requests were redirected so far, by kind (for tests and debugging)."""
    return dict(_COUNTS)
