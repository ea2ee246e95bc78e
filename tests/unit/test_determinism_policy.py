"""run.deterministic: on for CPU processes, off on GPUs unless asked for (issue 18, GPU defaults).

    python -m pytest tests/unit/test_determinism_policy.py -q
"""

import os

import pytest
import torch
import torch.utils.deterministic

from megatron_rl.config import from_dict
from megatron_rl.platform import apply_determinism
from megatron_rl.train.config import RunConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def restore_torch_state(monkeypatch):
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


@pytest.mark.parametrize("asked,cuda,on", [(None, False, True), (None, True, False), (False, False, False),
                                           (True, True, True)])
def test_resolution(restore_torch_state, asked, cuda, on):
    assert apply_determinism(asked, cuda=cuda) is on
    assert torch.are_deterministic_algorithms_enabled() is on


def test_asked_for_on_gpu_skips_the_nan_fill_and_fixes_cublas(restore_torch_state):
    apply_determinism(True, cuda=True)
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_config_default_is_auto():
    assert RunConfig().deterministic is None
    assert from_dict(RunConfig, {"deterministic": True}).deterministic is True
