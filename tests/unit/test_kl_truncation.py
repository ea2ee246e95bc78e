"""The KL to the reference under a truncating sampler (top-k / top-p), against the exact KL (issue 30, defect 8).

    python -m pytest tests/unit/test_kl_truncation.py -q

The policy π_θ is what the engine samples: logits / temperature, top-k then top-p, renormalised.
The reference is scored at the same temperature, untruncated (`SamplingConfig.untruncated`), so
the exact divergence is KL(π_θ‖π_ref) = Σ_{x∈S_θ} π_θ(x) log(π_θ(x)/π_ref(x)), finite.  Here a small
vocabulary whose reference ranks the tokens differently from the policy: two of the policy's kept
tokens fall outside the reference's own top-k set, which a truncated reference scores -87.3 (the
blow-up of the issue: KL 6-12 nats per token at step 2).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.grpo import GRPOLossConfig, grpo_loss, grpo_metrics
from megatron_rl.learner.config import SamplingConfig
from megatron_rl.learner.logprobs import OUT_OF_SUPPORT_LOGPROB, truncation_keep_mask

pytestmark = pytest.mark.unit

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.95, top_k=4)
THETA = [2.0, 1.6, 1.1, 0.9, 0.2, -0.5, -1.0, -3.0]  # the policy's logits (vocabulary of 8)
REF = [2.2, -0.4, 1.5, -0.8, 1.0, 0.7, 0.1, -2.0]    # the reference ranks tokens 1 and 3 low


def _scored(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log p over the vocabulary under `sampling`, as learner/logprobs.py scores it (cut tokens: -inf)."""
    tempered = logits / sampling.temperature
    keep = truncation_keep_mask(tempered.detach().float()[None], sampling)[0]
    return tempered.masked_fill(~keep, float("-inf")).log_softmax(-1)


def _per_token(log_theta: torch.Tensor, log_ref: torch.Tensor, x: int, estimator: str):
    """grpo_loss on one sampled token x (on-policy, advantage 0): its KL term and statistics."""
    cfg = GRPOLossConfig(kl_coef=1.0, kl_estimator=estimator)
    lp = log_theta[x].reshape(1, 1)
    return grpo_loss(lp, lp.detach(), log_ref[x].detach().reshape(1, 1), torch.zeros(1, dtype=lp.dtype),
                     torch.ones(1, 1, dtype=lp.dtype), cfg)


def test_the_reference_is_scored_untruncated_at_the_sampling_temperature(monkeypatch):
    """ranks/build.py Reference asks the learner for its logprobs at the rollout's
    temperature with top-k/top-p off, whatever the rollout truncates with."""
    import megatron_rl.conversion.model_io as model_io
    import megatron_rl.models.builder as builder
    from megatron_rl.ranks.build import Reference

    monkeypatch.setattr(builder, "build_gpt_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(model_io, "fill_from_hf", lambda *a, **k: None)
    asked = []
    learner = SimpleNamespace(
        sampling=SAMPLING, platform=None, config=None,
        cfg=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, lora=SimpleNamespace(enabled=False)),
        forward_logprobs=lambda tokens, lengths=None, model=None, sampling=None: asked.append(sampling))
    policy = SimpleNamespace(learner=learner, hf_cfg=None, checkpoint=None, tp_rank=0, padded_vocab=128)
    Reference(policy).logprobs(torch.zeros(1, 3, dtype=torch.long))
    assert asked == [SamplingConfig(temperature=0.7)]
    assert SAMPLING.untruncated == SamplingConfig(temperature=0.7)
    assert SamplingConfig(temperature=1.3).untruncated == SamplingConfig(temperature=1.3)  # nothing to drop


def test_the_penalty_follows_the_exact_kl_under_truncation():
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    log_theta = _scored(theta, SAMPLING)  # what the engine samples from
    log_ref = _scored(torch.tensor(REF, dtype=torch.float64), SAMPLING.untruncated)  # what Reference scores
    support = torch.isfinite(log_theta).nonzero().flatten().tolist()
    p = log_theta.detach().exp()
    # By hand: the policy's truncated distribution and the reference's whole one.
    r = torch.softmax(torch.tensor(REF, dtype=torch.float64) / 0.7, -1)
    torch.testing.assert_close(log_ref.exp(), r, rtol=0, atol=1e-15)
    exact = sum(float(p[x] * (math.log(p[x]) - math.log(r[x]))) for x in support)
    truncated_ref = _scored(torch.tensor(REF, dtype=torch.float64), SAMPLING)
    cut_by_the_reference = [x for x in support if not math.isfinite(float(truncated_ref[x]))]
    assert len(support) == 4 and cut_by_the_reference == [1, 3], "the case must sample tokens the reference cuts"

    # k1's value is unbiased: E_{x~π_θ}[k1] equals the exact KL.
    k1 = sum(float(p[x]) * float(_per_token(log_theta, log_ref, x, "k1")[1]["kl_sum"]) for x in support)
    assert k1 == pytest.approx(exact, abs=1e-12)
    assert 0 < exact < 2  # a KL of order 1, not the -87.3 blow-up

    # k2 (the default): the penalty's expected gradient is the gradient of the exact KL.
    expected_grad = sum(float(p[x]) * torch.autograd.grad(_per_token(log_theta, log_ref, x, "k2")[0], theta,
                                                         retain_graph=True)[0] for x in support)
    exact_kl = (log_theta.exp()[support] * (log_theta[support] - log_ref[support])).sum()
    (true_grad,) = torch.autograd.grad(exact_kl, theta, retain_graph=True)
    torch.testing.assert_close(expected_grad, true_grad, rtol=0, atol=1e-12)

    # The reported value (k3) is low by the reference's mass outside π_θ's support, as loss.py says.
    k3 = 0.0
    for x in support:
        stats = _per_token(log_theta, log_ref, x, "k2")[1]
        assert float(stats["kl_out_of_support_sum"]) == 0.0
        k3 += float(p[x]) * float(stats["kl_value_sum"])
    assert k3 == pytest.approx(exact - float(1 - r[support].sum()), abs=1e-12)


def test_tokens_without_a_finite_log_ratio_are_masked_and_counted():
    """A token the policy no longer keeps (OUT_OF_SUPPORT_LOGPROB) or the reference gives -inf adds
    nothing to the KL term and no gradient; the step counts them; the other tokens are unchanged."""
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(2, 3, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(2, 3, generator=g, dtype=torch.float64) * 3
    behavior = logprobs - 0.05
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    cfg = GRPOLossConfig(kl_coef=0.5, kl_estimator="k2")
    no_adv = torch.zeros(2, dtype=torch.float64)  # the KL term alone

    def run(lp, rf, m):
        lp = lp.clone().requires_grad_(True)
        loss, stats = grpo_loss(lp, behavior, rf, no_adv, m, cfg, token_denominator=5.0)
        return loss, stats, torch.autograd.grad(loss, lp)[0]

    moved, bad_ref = logprobs.clone(), ref.clone()
    moved[0, 1] = OUT_OF_SUPPORT_LOGPROB  # the policy moved: the sampled token left its top-k/top-p set
    bad_ref[1, 0] = float("-inf")
    loss, stats, grad = run(moved, bad_ref, mask)
    in_support = mask.clone()
    in_support[0, 1] = in_support[1, 0] = 0.0
    clean_loss, clean_stats, clean_grad = run(logprobs, ref, in_support)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert float(stats["kl_out_of_support_sum"]) == 2.0 and float(clean_stats["kl_out_of_support_sum"]) == 0.0
    assert grpo_metrics(stats, cfg)["kl_out_of_support_tokens"] == 2.0
    assert float(loss) == pytest.approx(float(clean_loss), abs=1e-12)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=1e-12)  # 0 at the two masked tokens
