"""The logged KL to the reference (`kl_ref_estimate`) against the exact KL of two categoricals.

    python -m pytest tests/unit/test_kl_value.py -q

The case is the one the main job runs into (configs/tiny_cpu.yaml, step 100): a reference that
puts ~98% of its mass on one token (EOS after the answer digit) and a policy the entropy bonus
spread over the whole vocabulary.  There k2's value E[δ²/2], the penalty's own metric, is
several times the KL; the k3 value the step reports is unbiased.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.grpo import GRPOLossConfig, grpo_loss, grpo_metrics

pytestmark = pytest.mark.unit

V = 128  # vocabulary rows, as the tiny model's


def _categoricals():
    ref_logits = torch.full((V,), -9.0, dtype=torch.float64)
    ref_logits[2] = 0.0  # the reference's EOS
    theta_logits = torch.linspace(-1.0, 1.0, V, dtype=torch.float64)  # nearly flat policy
    return torch.log_softmax(theta_logits, -1), torch.log_softmax(ref_logits, -1)


def _exact_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    return float((log_p.exp() * (log_p - log_q)).sum())


def _metrics_for(tokens: torch.Tensor, log_theta, log_ref, log_mu, estimator: str) -> dict:
    b = tokens.numel() // 2
    tokens_bt = tokens.reshape(b, 2)
    cfg = GRPOLossConfig(kl_coef=0.001, kl_estimator=estimator)
    _, stats = grpo_loss(log_theta[tokens_bt], log_mu[tokens_bt], log_ref[tokens_bt],
                         torch.zeros(b, dtype=torch.float64), torch.ones(b, 2, dtype=torch.float64), cfg)
    return grpo_metrics(stats, cfg)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_is_the_kl_per_token_whatever_the_penalty(estimator):
    log_theta, log_ref = _categoricals()
    exact = _exact_kl(log_theta, log_ref)
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(log_theta.exp(), 40_000, replacement=True, generator=g)
    metrics = _metrics_for(tokens, log_theta, log_ref, log_theta, estimator)
    assert metrics["kl_ref_estimate"] == pytest.approx(exact, rel=0.03)
    if estimator == "k2":  # the penalty's value, which the console showed before: not the KL here
        assert metrics["kl_ref_k2_grad_theta_ref"] > 2.0 * exact


def test_kl_estimate_off_policy_is_importance_weighted():
    """Tokens from μ ≠ π_θ: the estimate is still KL(π_θ‖π_ref), not KL(μ‖π_ref)."""
    log_theta, log_ref = _categoricals()
    log_mu = torch.log_softmax(torch.linspace(1.0, -1.0, V, dtype=torch.float64), -1)  # tilted the other way
    g = torch.Generator().manual_seed(1)
    tokens = torch.multinomial(log_mu.exp(), 40_000, replacement=True, generator=g)
    metrics = _metrics_for(tokens, log_theta, log_ref, log_mu, "k2")
    exact = _exact_kl(log_theta, log_ref)
    assert metrics["kl_ref_estimate"] == pytest.approx(exact, rel=0.03)
    assert abs(_exact_kl(log_mu, log_ref) - exact) > 0.1  # the two differ enough for the check to bite


def test_console_shows_the_kl_estimate_not_the_penalty_value():
    from megatron_rl.reporting.telemetry import progress_line

    metrics = {"learn/kl_ref_k2_grad_theta_ref": 7.22, "learn/kl_ref_estimate": 2.53}
    assert "| kl 2.53 " in progress_line(100, 100, metrics, seconds_per_step=1.0)
