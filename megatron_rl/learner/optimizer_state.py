"""Optimizer state before a checkpoint load, chosen by the inner optimizer's class.

    from megatron_rl.learner.optimizer_state import materialize_optimizer_state
    materialize_optimizer_state(megatron_optimizer)   # before sharded_state_dict(is_loading=True)

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
