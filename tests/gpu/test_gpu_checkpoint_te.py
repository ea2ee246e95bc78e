"""On a GPU: a learner checkpoint saves and resumes with Transformer Engine's FusedAdam (issue 18, defect 5).

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_checkpoint_te.py -q

One CUDA rank, bf16, TE layers: one step, a save through the learner's sharded_state_dict (the
memory-efficient reshardable format), a fresh learner that loads it (materialising optimizer state
per optimizer family: TE's FusedAdam keeps its step in param_groups), then weights and Adam moments
must be equal and the next step's loss must match the uninterrupted run's.
"""

import importlib.util

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed
from tests.dist.test_optimizer_checkpoint import _save_and_resume

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs transformer_engine"),
]


def test_te_fused_adam_checkpoint_resumes(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (out,) = run_distributed(_save_and_resume, 1, str(tmp_path / "ckpt"), device="cuda", timeout=600)
    assert out["optimizer"] == "FusedAdam", out["optimizer"]
    assert out["held"] and out["params"] and out["moments"]
    assert out["resumed"] == pytest.approx(out["after"], rel=1e-3)
