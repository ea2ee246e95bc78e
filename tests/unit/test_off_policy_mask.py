"""Corrections for stale samples (issue 47 item 3): `loss.off_policy_mask` "icepop" and "m2po", each against
its formula computed by hand here (grpo/loss.py's docstring has them).

    python -m pytest tests/unit/test_off_policy_mask.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.grpo.loss import GRPOLossConfig, grpo_loss, off_policy_weights
from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss
from megatron_rl.grpo.step_metrics import grpo_metrics
from megatron_rl.reporting.telemetry import _learn_metrics

pytestmark = pytest.mark.unit


def _batch():
    torch.manual_seed(0)
    behavior = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3], [0.4, 0.05, 0.6, 0.2]]))
    # the learner's log-probs at the step's start: ratios π/μ of 1, 2, 8, 0.3 and 1.25, 6, 0.5, 0.4
    ratios = torch.tensor([[1.0, 2.0, 8.0, 0.3], [1.25, 6.0, 0.55, 0.4]])
    logprobs = (behavior + ratios.log()).clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -0.5])
    return logprobs, behavior, mask, adv, ratios


def test_icepop_weighs_by_the_ratio_inside_its_band_and_masks_outside():
    logprobs, behavior, mask, adv, ratios = _batch()
    cfg = GRPOLossConfig(off_policy_mask="icepop", icepop_low=0.5, icepop_high=5.0)
    loss, stats = grpo_loss(logprobs, behavior, None, adv, mask, cfg, old_logprobs_bt=logprobs.detach())
    loss.backward()
    # by hand: anchor = π_old = π_θ, so r = 1, no clipping, d(-r Â w)/d log π = -Â w; token mean over 7 tokens
    k = ratios
    w = torch.where((k >= 0.5) & (k <= 5.0), k, torch.zeros_like(k)) * mask
    expected_grad = -(adv[:, None] * w) / mask.sum()
    assert torch.allclose(logprobs.grad, expected_grad, atol=1e-6)
    assert torch.allclose(loss, (-(adv[:, None] * w)).sum() / mask.sum(), atol=1e-6)
    # masked: 8 (above 5), 0.3 (below 0.5), 6 (above 5)
    assert float(stats["off_policy_masked_sum"]) == 3.0
    metrics = grpo_metrics({k_: v for k_, v in stats.items()}, cfg)
    assert math.isclose(metrics["off_policy_masked_fraction"], 3 / 7, rel_tol=1e-6)
    # and it reaches the run's metrics (learn/, the panel's series): it did not, until a run looked for it
    logged = _learn_metrics([], [], metrics, np.array([]))
    assert math.isclose(logged["learn/off_policy_masked_fraction"], 3 / 7, rel_tol=1e-6)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_second_moment_fits():
    logprobs, behavior, mask, adv, ratios = _batch()
    tau = 0.3
    w = off_policy_weights(logprobs.detach(), behavior, behavior, mask, GRPOLossConfig(off_policy_mask="m2po",
                                                                                       m2po_threshold=tau))
    # by hand: s = (log r)^2 of the 7 tokens, masked greedily from the largest
    s = [math.log(r) ** 2 for r in (1.0, 2.0, 8.0, 0.3, 1.25, 6.0, 0.55)]
    order = sorted(range(7), key=lambda i: -s[i])
    kept = list(range(7))
    for i in order:
        if sum(s[j] for j in kept) / len(kept) <= tau:
            break
        kept.remove(i)
    expected = torch.zeros(7)
    expected[kept] = 1.0
    got = w[mask > 0]
    assert torch.equal(got, expected), (got, expected)
    assert sum(s[j] for j in kept) / len(kept) <= tau < sum(s) / 7
    assert float(w[1, 3]) == 0.0  # padding never counts
    # a batch within τ loses nothing; a huge τ keeps all, a tiny one keeps only tokens with s <= τ
    on_policy = off_policy_weights(behavior, behavior, behavior, mask, GRPOLossConfig(off_policy_mask="m2po"))
    assert torch.equal(on_policy, mask)


def test_m2po_in_the_loss_zeroes_the_masked_tokens_gradient_and_keeps_the_others():
    logprobs, behavior, mask, adv, _ = _batch()
    cfg = GRPOLossConfig(off_policy_mask="m2po", m2po_threshold=0.3, clip_eps_low=0.2, clip_eps_high=0.2)
    loss, stats = grpo_loss(logprobs, behavior, None, adv, mask, cfg)
    loss.backward()
    w = off_policy_weights(logprobs.detach(), behavior, behavior, mask, cfg)
    plain = logprobs.detach().clone().requires_grad_(True)
    base, _ = grpo_loss(plain, behavior, None, adv, mask, GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    base.backward()
    assert torch.allclose(logprobs.grad, plain.grad * w, atol=1e-7)
    assert float(stats["off_policy_masked_sum"]) == float(((w == 0) & (mask > 0)).sum())


def test_the_options_are_checked_and_the_learner_passes_pi_old_for_icepop():
    with pytest.raises(ValueError, match="off_policy_mask must be 'icepop', 'm2po' or null"):
        GRPOLossConfig(off_policy_mask="popcorn")
    with pytest.raises(ValueError, match="set tis_cap or icepop, not both"):
        GRPOLossConfig(off_policy_mask="icepop", tis_cap=2.0)
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        GRPOLossConfig(off_policy_mask="icepop", icepop_low=1.5)
    with pytest.raises(ValueError, match="m2po_threshold must be > 0"):
        GRPOLossConfig(off_policy_mask="m2po", m2po_threshold=0)
    logprobs, behavior, mask, adv, _ = _batch()
    with pytest.raises(ValueError, match="pass old_logprobs_bt"):
        grpo_loss(logprobs, behavior, None, adv, mask, GRPOLossConfig(off_policy_mask="icepop"))
    mb = {"behavior_logprobs": behavior, "advantages": adv, "loss_mask": mask, "tokens_in_loss": 7.0,
          "sequences_in_loss": 2.0, "num_micro_batches": 1}
    loss, stats = grpo_micro_batch_loss(logprobs, mb, GRPOLossConfig(off_policy_mask="icepop"))
    assert float(stats["off_policy_masked_sum"]) == 3.0
