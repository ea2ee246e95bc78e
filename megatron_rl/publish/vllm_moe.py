"""vLLM's CPU MoE layers across a weight reload: the experts are re-prepared from the new weights.

Used by publish/vllm_reload.reload_weights (every publication, rollback and refit):

    disarm_moe_kernels(model); <layerwise reload>; rearm_moe_kernels(model)

Tested by tests/e2e/test_moe_reload.py (python -m pytest tests/e2e/test_moe_reload.py -q).
"""

from __future__ import annotations

import torch

_DISARMED = "_megatron_rl_disarmed_moe_kernel"


def _layer_prepared_experts(module: torch.nn.Module):
    """The quant method of a fused-MoE layer whose experts kernel re-lays its weights out
    from the layer after loading (vLLM's CPU experts: intermediate padding, then prepacking
    into their grouped-GEMM layout), else None."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    own = type(experts).process_weights_after_loading
    return method if own is not FusedMoEExperts.process_weights_after_loading else None


def disarm_moe_kernels(model: torch.nn.Module) -> int:
    """Make the next reload prepare every CPU MoE layer's experts as a first load does.

    vLLM 0.32's unquantized MoE method, on a reload (`moe_kernel` already built), copies the
    loaded weights in the checkpoint layout into the parameters and skips the experts
    kernel's own `process_weights_after_loading`: on CPU the serving parameters keep the
    prepacked (and padded) layout of the first load and get unpacked bytes, so every refit
    corrupts the experts (probe logprobs off by ~0.6 nats) or fails on a padded width.
    With `moe_kernel` cleared, the reload's `process_weights_after_loading` rebuilds the
    kernel and pads and prepacks the new weights; the layerwise reload then copies that
    result into the original storage.  Only on CPU (GPU kernels may be captured in CUDA
    graphs, and their experts need no per-layer preparation today).  Returns the number of
    layers disarmed; `rearm_moe_kernels` puts back any kernel a reload did not rebuild."""
    if torch.cuda.is_available():
        return 0
    count = 0
    for module in model.modules():
        method = _layer_prepared_experts(module)
        if method is not None:
            setattr(method, _DISARMED, method.moe_kernel)
            method.moe_kernel = None
            count += 1
    return count


def rearm_moe_kernels(model: torch.nn.Module) -> None:
    """After a reload: a MoE layer the reload did not process (no weights for it, or a load
    that failed before it) gets its previous kernel back, its weights untouched."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, _DISARMED):
            continue
        previous = getattr(method, _DISARMED)
        delattr(method, _DISARMED)
        if method.moe_kernel is None:
            method.moe_kernel = previous
