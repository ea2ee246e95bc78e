"""Where the learner runs: device, collective backend, dtype and Transformer Engine use.

    from megatron_rl.platform import detect_platform, layer_spec
    platform = detect_platform()            # cuda/nccl/bf16 (+TE) on GPUs, cpu/gloo/fp32 here
    platform = detect_platform("cpu")       # force the CPU path (tests, debugging)
    spec = layer_spec(platform, hf_cfg)     # Megatron ModuleSpec of one transformer layer
    block = block_spec(platform, hf_cfg, transformer_config, pp_rank)  # this stage's layers + final norm

Everything that differs between the GPU and the CPU path is decided here once, so the model
builder, the learner and the tests never test `torch.cuda.is_available()` themselves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import TYPE_CHECKING

from megatron_rl.te_import import TEUnavailable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The dtypes a learner computes in, by their config name -> torch's.  torch is imported where a platform is
detected, not with the package: its pure-Python modules (cores, local_ray, listen) stay light."""


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPE_NAMES[name])


@dataclasses.dataclass(frozen=True)
class Platform:
    """The device the learner computes on and how its processes talk."""

    device: torch.device
    """cuda (the local rank's GPU) or cpu."""
    backend: str
    """torch.distributed backend: "nccl" on GPUs, "gloo" on CPU."""
    dtype: torch.dtype
    """Parameter / compute dtype of the model."""
    use_te: bool
    """Build layers from Transformer Engine modules (GPU only)."""

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def dtype_name(self) -> str:
        return next(name for name in DTYPE_NAMES if torch_dtype(name) == self.dtype)


def _te_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except TEUnavailable:  # already logged with its cause by megatron_rl/te_import.py
        return False
    except (ImportError, OSError, RuntimeError) as err:
        logger.warning("transformer_engine is installed but does not import (%s); using local layers", err)
        return False
    return True


def detect_platform(device: str | None = None, dtype: str | None = None) -> Platform:
    """Pick cuda/nccl/bf16/TE when a GPU is visible, else cpu/gloo/fp32.

    device: None (auto), "cpu" or "cuda".  dtype: None (platform default), "fp32", "bf16", "fp16".
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
    import torch

    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but torch.cuda.is_available() is False")
    if use_cuda:
        index = torch.cuda.current_device()
        return Platform(
            device=torch.device("cuda", index),
            backend="nccl",
            dtype=torch_dtype(dtype or "bf16"),
            use_te=_te_available(),
        )
    return Platform(device=torch.device("cpu"), backend="gloo", dtype=torch_dtype(dtype or "fp32"), use_te=False)


def apply_determinism(deterministic: bool | None, cuda: bool) -> bool:
    """Set torch's deterministic-algorithms mode for this process; returns whether it is on.

    None (run.deterministic's default) means on for CPU processes, off on GPUs.  On a GPU the mode
    makes every torch.empty NaN-fill its memory (a debugging aid that costs a memory pass per
    allocation), warns on cuBLAS without a fixed workspace, and swaps in slower kernels; and the
    GPU path is not bitwise reproducible anyway (NCCL reduction order, TE/cuDNN kernels).  Asked for
    explicitly on a GPU, it is honoured without the NaN fill and with cuBLAS's fixed workspace.
    """
    import torch

    on = (not cuda) if deterministic is None else bool(deterministic)
    torch.use_deterministic_algorithms(on, warn_only=True)
    if on and cuda:
        import os

        from torch.utils import deterministic as det

        det.fill_uninitialized_memory = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS handle creation
    return on


def layer_spec(platform: Platform, hf_cfg=None):
    """Megatron ModuleSpec of one GPT layer for `platform`: TE modules on GPUs, local ones on CPU.

    Llama and Qwen2 use RMSNorm before attention and MLP and no query/key norm; Qwen3 adds an
    RMSNorm on each query and key head (`hf_cfg.qk_layernorm`), which turns on qk_layernorm in
    either spec.  The local spec is told RMSNorm explicitly (the TE spec reads
    `config.normalization` at build time).  A MoE model (`hf_cfg.moe`, Qwen3-MoE) gets Megatron's
    MoE layer (router, token dispatcher, experts) in place of the dense MLP, with one MLP module per
    expert (SequentialMLP, no grouped GEMM: per-expert weights keep the names the converter and the
    publisher map; grouped GEMM needs CUDA kernels).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    qk_layernorm = bool(getattr(hf_cfg, "qk_layernorm", False))
    moe = getattr(hf_cfg, "moe", None)
    experts = dict(num_experts=moe.num_experts, moe_grouped_gemm=False) if moe is not None else {}
    if platform.use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **experts)
    return get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **experts)


def final_norm(platform: Platform) -> type:
    """The module class of the decoder's final norm on `platform`: TE's norm on the TE platform, else the
    local one (torch's RMSNorm through Megatron's WrappedTorchNorm, as the local layer spec's norms).

    Left to Megatron-Core 0.16, the final norm is TENorm whenever TE imports (its module global
    transformer_block.LayerNormImpl), even for a CPU model built with the local spec, and TE's RMSNorm
    has no CPU kernel: a CPU-forced tool on a machine with TE would fail at the first forward (issue 31,
    read from the sources; no GPU machine has run this yet; tests/unit/test_te_unusable.py stands in).
    """
    if platform.use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def block_spec(platform: Platform, hf_cfg, config, pp_rank: int):
    """Megatron TransformerBlockSubmodules of pipeline stage `pp_rank`: its layers (layer_spec) and the
    final norm (final_norm), both chosen from `platform`.  `config` is the model's TransformerConfig."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(platform, hf_cfg)] * layers,
                                      layer_norm=final_norm(platform))
