"""Loss statistics land on the loss's device (issue 18, defect 2).

    python -m pytest tests/unit/test_learner_metrics_device.py -q

On a GPU the loss is a CUDA tensor; a statistic returned as a Python float used to become a CPU
tensor next to it, against the loss interface's contract (statistics on the loss's device).
reduce_step_stats itself already moved every value to the platform device, so the step did not
crash; the defect as filed ("CPU tensors stacked with the CUDA loss") was not reproduced.  Here the loss lives on the 'meta' device, which
any CPU machine has, so a statistic left on the CPU shows.  `token_logprobs` (which needs
Megatron's parallel state) is replaced by a test double that hands the logits through.
"""

from types import SimpleNamespace

import pytest
import torch

import megatron_rl.learner.learner as learner_mod
from megatron_rl.learner.learner import Learner

pytestmark = pytest.mark.unit


def test_float_statistics_follow_the_loss_device(monkeypatch):
    monkeypatch.setattr(learner_mod, "token_logprobs", lambda logits, tokens, vocab, sampling: logits)
    fake = SimpleNamespace(hf_cfg=SimpleNamespace(vocab_size=8), sampling=None)
    logits = torch.empty(2, 5, device="meta", requires_grad=True)

    def loss_fn(logprobs_bt, mb):
        return logprobs_bt.sum(), {"rows": 2.0, "tokens": logprobs_bt.detach().sum(), "seq": logprobs_bt.sum(1)}

    loss, reported = Learner._loss_on_logits(fake, loss_fn, {"tokens": None}, logits)
    assert loss.device.type == "meta"
    assert {k: v.device.type for k, v in reported.items()} == dict.fromkeys(["rows", "tokens", "seq", "loss"], "meta")
    assert all(v.dtype == torch.float32 for v in reported.values())
