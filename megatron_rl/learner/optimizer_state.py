"""Optimizer state around a checkpoint load, chosen by the inner optimizer's class.

    from megatron_rl.learner.optimizer_state import materialize_optimizer_state
    materialize_optimizer_state(megatron_optimizer)   # before sharded_state_dict(is_loading=True)
    unshare_adam_steps(megatron_optimizer)            # after optimizer.load_state_dict(...)
    patch_torch_adam_state_loading(megatron_optimizer)  # once, when the optimizer is built

    python -m pytest tests/unit/test_optimizer_state.py -q

Megatron-Core builds its loading template from the inner optimizer's `state_dict()`.  What
that template needs differs per optimizer family:

* torch.optim.Adam / AdamW (Megatron's fallback without Transformer Engine or Apex) keeps a
  per-parameter 'step' tensor and has no state until its first step; the distributed
  optimizer's template then fails on the missing 'step'.  Zeros for exp_avg / exp_avg_sq and a
  step-0 tensor are given to every parameter (the loaded checkpoint overwrites them).
* Transformer Engine's / Apex's FusedAdam keep the step in `param_groups` and only
  exp_avg / exp_avg_sq (/ master_param) per parameter.  TE's `FusedAdam.state_dict()` looks
  every state key up in its dtype map, so a per-parameter 'step' makes it raise KeyError.  Their
  state is left to Megatron, which allocates it itself for these optimizers
  (`DistributedOptimizer.load_state_dict`, `init_state_fn`).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron (possibly chained) optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def keeps_step_per_parameter(inner) -> bool:
    """True for torch's Adam family (per-parameter 'step' state), False for fused optimizers."""
    return isinstance(inner, torch.optim.Adam)


def materialize_optimizer_state(optimizer) -> None:
    """Give each inner optimizer the state its family needs before a checkpoint load."""
    for inner in inner_optimizers(optimizer):
        if keeps_step_per_parameter(inner):
            _materialize_torch_adam(inner)
        else:
            logger.debug("%s keeps its step in param_groups: state left to Megatron-Core",
                         type(inner).__name__)


def _materialize_torch_adam(inner: torch.optim.Optimizer) -> None:
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p.data)
                state["exp_avg_sq"] = torch.zeros_like(p.data)
            state.setdefault("step", torch.tensor(0.0))


def unshare_adam_steps(optimizer) -> None:
    """Give each parameter its own Adam 'step' tensor after a load.

    Megatron restores torch Adam's step by assigning ONE tensor to every parameter's state;
    torch's Adam then increments it in place once per parameter, so bias correction would
    run ahead after a resume.  A private copy per parameter restores torch's semantics.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def patch_torch_adam_state_loading(optimizer) -> None:
    """Let Megatron-Core 0.16's distributed optimizer load checkpoints into torch.optim.Adam.

    Without Apex/TE the inner optimizer is torch's Adam, whose per-parameter state carries a
    'step' tensor.  `load_parameter_state_from_fully_reshardable` leaves 'step' out of the
    tensors it hands to `_set_main_param_and_optimizer_states` (step is restored from the
    param groups instead), but that method copies every key of the *destination* state and
    fails with KeyError('step').  Copy the keys that were loaded instead.  Only applied where
    the inner optimizer is torch's Adam; Apex/TE optimizers keep Megatron's method.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or not isinstance(opt.optimizer, torch.optim.Adam):
            continue
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue

        def set_states(model_param, tensors, _opt=opt):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **_opt.optimizer.state[main_param]}
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states
