"""Optimizer-state materialisation before a checkpoint load, per optimizer family (issue 18, defect 5).

    python -m pytest tests/unit/test_optimizer_state.py -q

Transformer Engine's FusedAdam needs CUDA to construct, so `FusedAdamStandIn` below is a test
double: a CPU optimizer that reproduces the one behaviour at stake, FusedAdam.state_dict()
looking every per-parameter state key up in its `name_to_dtype_map` (TE 2.x,
transformer_engine/pytorch/optimizers/fused_adam.py: state_dict -> get_unscaled_state), and
keeping its step in param_groups.  The test goes through Learner._materialize_optimizer_state,
the method the learner calls before building its loading template.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.learner.learner import Learner
from megatron_rl.learner.optimizer_state import keeps_step_per_parameter

pytestmark = pytest.mark.unit


class FusedAdamStandIn(torch.optim.Optimizer):
    """CPU stand-in for TE FusedAdam's state_dict contract (not an Adam implementation)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                                  "master_param": torch.float32}

    def state_dict(self):
        sd = super().state_dict()
        for index, state in sd["state"].items():
            sd["state"][index] = {name: self._unscaled(value, name) for name, value in state.items()}
        return sd

    def _unscaled(self, value, name):
        dtype = self.name_to_dtype_map[name]  # KeyError('step') in TE for a per-parameter step
        return value.to(dtype)


def _fake_learner(inner):
    """The attributes _materialize_optimizer_state reads: a Megatron optimizer wrapping `inner`."""
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer=inner))


def _params():
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


def test_fused_adam_state_dict_survives_materialisation():
    inner = FusedAdamStandIn(_params())
    Learner._materialize_optimizer_state(_fake_learner(inner))
    sd = inner.state_dict()  # raised KeyError('step') before the fix
    assert all("step" not in state for state in sd["state"].values())
    assert not keeps_step_per_parameter(inner)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_torch_adam_gets_zero_moments_and_step(cls):
    params = _params()
    inner = cls(params, lr=1e-3)
    Learner._materialize_optimizer_state(_fake_learner(inner))
    for p in params:
        state = inner.state[p]
        assert float(state["step"]) == 0.0
        assert torch.equal(state["exp_avg"], torch.zeros_like(p)) and state["exp_avg_sq"].shape == p.shape
    assert len(inner.state_dict()["state"]) == len(params)


def test_existing_torch_adam_state_is_kept():
    params = _params()
    inner = torch.optim.Adam(params, lr=1e-2)
    params[0].grad = torch.ones_like(params[0])
    inner.step()
    before = inner.state[params[0]]["exp_avg"].clone()
    Learner._materialize_optimizer_state(_fake_learner(inner))
    assert torch.equal(inner.state[params[0]]["exp_avg"], before)
    assert float(inner.state[params[0]]["step"]) == 1.0
    assert float(inner.state[params[1]]["step"]) == 0.0
