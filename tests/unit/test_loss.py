"""GRPO loss and advantages against hand-written loops over plain Python floats.

    python -m pytest tests/unit/test_loss.py -q
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.grpo import (
    GRPOLossConfig,
    compute_advantages,
    group_advantages,
    grpo_loss,
    grpo_metrics,
    grpo_step_weight,
    kl_estimate,
    lag_guard_weight,
    rewards_from_scores,
)
from megatron_rl.reward import RewardConfig, Score, score_response

pytestmark = pytest.mark.unit


def _batch(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    logprobs = behavior + 0.4 * (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5)
    ref = behavior + 0.3 * (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)[:b]
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logprobs, behavior, ref, adv, mask


def _loop_loss(lp, mu, ref, adv, mask, eps_lo, eps_hi, beta, est, agg, old=None, cap=None):
    """Independent reference: one token at a time, Python floats.  The KL term carries the
    per-token importance weight π_θ/μ (kl_importance_correction, the default)."""
    per_seq, all_tok = [], []
    for i in range(len(lp)):
        toks = []
        for j in range(len(lp[i])):
            if mask[i][j] == 0:
                continue
            anchor = mu[i][j] if old is None else old[i][j]
            r = math.exp(lp[i][j] - anchor)
            rc = min(max(r, 1 - eps_lo), 1 + eps_hi)
            pg = -min(r * adv[i], rc * adv[i])
            if cap is not None:
                pg *= min(math.exp(old[i][j] - mu[i][j]), cap)
            d = ref[i][j] - lp[i][j]
            k = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[est]
            toks.append(pg + beta * math.exp(lp[i][j] - mu[i][j]) * k)
        all_tok += toks
        if toks:
            per_seq.append(sum(toks) / len(toks))
    return sum(all_tok) / len(all_tok) if agg == "token" else sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_loss_matches_token_loop(agg, est):
    lp, mu, ref, adv, mask = _batch()
    cfg = GRPOLossConfig(clip_eps_low=0.1, clip_eps_high=0.15, kl_coef=0.05, kl_estimator=est, aggregation=agg)
    loss, stats = grpo_loss(lp, mu, ref, adv, mask, cfg)
    expected = _loop_loss(lp.tolist(), mu.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.1, 0.15, 0.05, est, agg)
    assert float(loss) == pytest.approx(expected, rel=1e-10)
    metrics = grpo_metrics(stats, cfg)
    assert metrics["tokens"] == float(mask.sum())
    assert metrics["loss"] == pytest.approx(expected, rel=1e-10)


def test_tis_weights_match_loop():
    lp, mu, ref, adv, mask = _batch(seed=3)
    old = mu + torch.tensor([[0.9, -0.2, 0.1, 2.0, 0.0]] * 3, dtype=torch.float64)
    cfg = GRPOLossConfig(tis_cap=2.0)
    loss, stats = grpo_loss(lp, mu, None, adv, mask, cfg, old_logprobs_bt=old)
    metrics = grpo_metrics(stats, cfg)
    expected = _loop_loss(
        lp.tolist(), mu.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, 0.0, "k1", "token",
        old=old.tolist(), cap=2.0,
    )
    assert float(loss) == pytest.approx(expected, rel=1e-10)
    # offsets 0.9 and 2.0 give exp() > 2: truncated wherever those columns are unmasked.
    offsets = [0.9, -0.2, 0.1, 2.0, 0.0]
    truncated = sum(1 for row in mask.tolist() for j, m in enumerate(row) if m and math.exp(offsets[j]) > 2.0)
    assert truncated == 4
    assert metrics["tis_truncated_fraction"] == pytest.approx(truncated / float(mask.sum()))


def test_tis_without_old_logprobs_is_an_error():
    lp, mu, _, adv, mask = _batch()
    with pytest.raises(ValueError, match="old_logprobs_bt"):
        grpo_loss(lp, mu, None, adv, mask, GRPOLossConfig(tis_cap=2.0))


def test_on_policy_ratio_is_one_and_gradient_follows_advantage():
    _, mu, _, _, mask = _batch()
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    lp = mu.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, mu, None, adv, mask, GRPOLossConfig())
    metrics = grpo_metrics(stats, GRPOLossConfig())
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["ratio_max"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["d_lag"] == pytest.approx(0.0)
    loss.backward()
    # Descending the loss must raise log-probs of positive-advantage tokens, lower negative ones.
    assert (lp.grad[0][mask[0] > 0] < 0).all()
    assert (lp.grad[1][mask[1] > 0] > 0).all()
    assert (lp.grad[2] == 0).all()
    assert (lp.grad[mask == 0] == 0).all()


def test_clip_high_side_stops_gradient_for_positive_advantage():
    mu = torch.zeros(1, 2, dtype=torch.float64) - 1.0
    lp = (mu + torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=torch.float64)).requires_grad_(True)
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.3)
    loss, stats = grpo_loss(lp, mu, None, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2), cfg)
    metrics = grpo_metrics(stats, cfg)
    loss.backward()
    # token 0: r=1.5 > 1.3 -> clipped term 1.3*2 selected, constant; token 1: r=1.1 inside.
    assert float(loss) == pytest.approx(-(1.3 * 2 + 1.1 * 2) / 2)
    assert lp.grad[0, 0] == 0
    assert lp.grad[0, 1] == pytest.approx(-1.1 * 2 / 2)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_clip_low_side_stops_gradient_for_negative_advantage():
    mu = torch.zeros(1, 2, dtype=torch.float64) - 1.0
    lp = (mu + torch.tensor([[math.log(0.5), math.log(1.6)]], dtype=torch.float64)).requires_grad_(True)
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.3)
    loss, stats = grpo_loss(lp, mu, None, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2), cfg)
    metrics = grpo_metrics(stats, cfg)
    loss.backward()
    # token 0: r=0.5 < 0.8 -> clipped 0.8*(-1) is the min -> constant; token 1: r=1.6, min picks unclipped.
    assert float(loss) == pytest.approx(-(-0.8 + -1.6) / 2)
    assert lp.grad[0, 0] == 0
    assert lp.grad[0, 1] == pytest.approx(1.6 / 2)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_max"] == pytest.approx(1.6)


def test_kl_estimators_formula_and_sign():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(200, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(200, generator=g, dtype=torch.float64) * 3
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(lp, ref, est)
        for a, b, k in zip(lp.tolist(), ref.tolist(), got.tolist()):
            r = math.exp(b - a)
            want = {"k1": -math.log(r), "k2": 0.5 * math.log(r) ** 2, "k3": (r - 1) - math.log(r)}[est]
            assert k == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert (kl_estimate(lp, ref, "k2") >= 0).all()
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert (kl_estimate(lp, ref, "k1") < 0).any()
    assert (kl_estimate(lp, lp, "k3") == 0).all()


def test_kl_penalty_gradient_pulls_toward_reference():
    mu = torch.full((1, 3), -1.0, dtype=torch.float64)
    ref = torch.full((1, 3), -1.0, dtype=torch.float64)
    lp = torch.full((1, 3), -0.5, dtype=torch.float64, requires_grad=True)  # above the reference
    for est in ("k2", "k3"):
        lp.grad = None
        cfg = GRPOLossConfig(kl_coef=1.0, kl_estimator=est)
        loss, stats = grpo_loss(lp, mu, ref, torch.zeros(1, dtype=torch.float64), torch.ones(1, 3), cfg)
        loss.backward()
        assert (lp.grad > 0).all()  # descent lowers log π_θ toward π_ref
        metrics = grpo_metrics(stats, cfg)
        # Off-policy (μ = e^-1, π_θ = e^-0.5): the KL term carries the weight π_θ/μ = e^0.5.
        k = {"k2": 0.5 * 0.5**2, "k3": math.exp(-0.5) - 1 + 0.5}[est]
        assert metrics[f"kl_ref_{est}_grad_" + {"k2": "theta_ref", "k3": "ref_theta"}[est]] == pytest.approx(
            math.exp(0.5) * k)
        assert metrics["d_lag"] == pytest.approx(0.5)


@pytest.mark.parametrize("action", ["quarantine", "downweight"])
def test_lag_guard_weight_from_batch_wide_d_lag(action):
    # The guard no longer touches the loss (it acted per micro-batch): grpo_step_weight turns the
    # batch's summed statistics into D_lag and a gradient weight for the learner's step.
    lp, mu, _, adv, mask = _batch()
    base, stats = grpo_loss(lp, mu, None, adv, mask, GRPOLossConfig())
    d_lag = sum(abs(a - b) for ra, rb, rm in zip(lp.tolist(), mu.tolist(), mask.tolist())
                for a, b, m in zip(ra, rb, rm) if m) / float(mask.sum())
    assert grpo_metrics(stats, GRPOLossConfig())["d_lag"] == pytest.approx(d_lag)
    cfg = GRPOLossConfig(lag_threshold=d_lag / 2, lag_action=action)
    guarded, _ = grpo_loss(lp, mu, None, adv, mask, cfg)
    assert float(guarded) == float(base)
    weight, m = grpo_step_weight(stats, cfg)
    if action == "quarantine":
        assert weight == 0.0 and m["lag_quarantined"] == 1.0
    else:
        assert weight == pytest.approx(0.5) and m["lag_weight"] == pytest.approx(0.5) and m["lag_quarantined"] == 0.0
    # Under the threshold nothing changes.
    weight2, m2 = grpo_step_weight(stats, GRPOLossConfig(lag_threshold=d_lag * 2, lag_action=action))
    assert weight2 == 1.0 and m2["lag_weight"] == 1.0 and m2["lag_quarantined"] == 0.0
    assert lag_guard_weight(d_lag, GRPOLossConfig()) == 1.0


def test_padding_values_do_not_leak():
    lp, mu, ref, adv, mask = _batch()
    lp2, mu2 = lp.clone(), mu.clone()
    lp2[mask == 0] = -float("inf")
    mu2[mask == 0] = float("nan")
    lp2.requires_grad_(True)
    loss, stats = grpo_loss(lp2, mu2, ref, adv, mask, GRPOLossConfig(kl_coef=0.1), entropy_bt=torch.ones_like(lp))
    m = grpo_metrics(stats, GRPOLossConfig(kl_coef=0.1))
    loss.backward()
    ref_loss, _ = grpo_loss(lp, mu, ref, adv, mask, GRPOLossConfig(kl_coef=0.1))
    assert float(loss) == pytest.approx(float(ref_loss))
    assert torch.isfinite(lp2.grad).all() and m["entropy"] == pytest.approx(1.0)


def test_group_advantages_match_loop_and_skip_invalid():
    rewards = torch.tensor([[1.0, 0.0, 1.0, float("nan")], [0.5, 0.5, 0.5, 0.5], [1.0, float("nan"), 0.0, 0.0]])
    valid = ~torch.isnan(rewards)
    adv, keep, stats = group_advantages(rewards, valid, eps=1e-6)
    for n in range(3):
        vals = [float(r) for r, v in zip(rewards[n], valid[n]) if v]
        mean, std = statistics.mean(vals), statistics.stdev(vals)
        for g in range(4):
            if not valid[n, g]:
                assert adv[n, g] == 0 and not keep[n, g]
            else:
                want = 0.0 if std == 0 else (float(rewards[n, g]) - mean) / max(std, 1e-6)
                assert float(adv[n, g]) == pytest.approx(want, rel=1e-6)
    assert stats["zero_variance_groups"] == 1.0
    assert stats["invalid_samples"] == 2.0
    assert keep[1].all()
    _, keep_f, stats_f = group_advantages(rewards, valid, filter_zero_variance=True)
    assert not keep_f[1].any() and stats_f["kept_samples"] == 6.0


def test_batch_baseline_matches_loop_and_moves_equal_reward_groups():
    from megatron_rl.grpo.advantages import batch_advantages
    from megatron_rl.grpo.loss import compute_advantages

    rewards = torch.tensor([[1.0, 0.0, 1.0, float("nan")], [0.0, 0.0, 0.0, 0.0], [1.5, 1.5, 1.5, 1.5]])
    valid = ~torch.isnan(rewards)
    adv, keep, stats = compute_advantages(rewards, valid, GRPOLossConfig(advantage_baseline="batch"))
    vals = [float(r) for r, v in zip(rewards.flatten(), valid.flatten()) if v]
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    for n in range(3):
        for g in range(4):
            want = 0.0 if not valid[n, g] else (float(rewards[n, g]) - mean) / std
            assert float(adv[n, g]) == pytest.approx(want, rel=1e-6)
    # The all-wrong group is pushed away from what it sampled, the all-right one towards it;
    # under the group baseline both carry nothing.
    assert (adv[1] < 0).all() and (adv[2] > 0).all()
    assert stats["zero_variance_groups"] == 2.0 and not keep[0, 3]
    group_adv, _, _ = compute_advantages(rewards, valid, GRPOLossConfig())
    assert group_adv[1:].abs().sum() == 0
    flat, _, _ = batch_advantages(torch.ones(2, 3))
    assert flat.abs().sum() == 0  # no variance anywhere: no signal, no division by ~0
    with pytest.raises(ValueError, match="advantage_baseline"):
        GRPOLossConfig(advantage_baseline="batch", filter_zero_variance=True)


def test_group_with_one_valid_member_has_no_signal():
    rewards = torch.tensor([[1.0, float("nan")]])
    adv, keep, stats = group_advantages(rewards, ~torch.isnan(rewards), filter_zero_variance=True)
    assert adv.abs().sum() == 0 and stats["zero_variance_groups"] == 1.0 and not keep.any()


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="clip_eps_low"):
        GRPOLossConfig(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOLossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="lag_action"):
        GRPOLossConfig(lag_action="drop")
    lp, mu, _, adv, mask = _batch()
    with pytest.raises(ValueError, match="behavior_logprobs_bt shape"):
        grpo_loss(lp, mu[:, :2], None, adv, mask, GRPOLossConfig())
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[float("nan"), 1.0]]))


def test_scores_to_loss_excludes_failed_graders():
    cfg_r = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"], format_weight=0.0)
    version = cfg_r.grader_version()
    scores = [score_response("7", "7", cfg_r), Score.failed("timeout", version), score_response("1", "7", cfg_r),
              score_response("2", "2", cfg_r), score_response("2", "2", cfg_r), Score.failed("crash", version)]
    rewards, valid = rewards_from_scores(scores, group_size=3)
    assert valid.tolist() == [[True, False, True], [True, True, False]]
    cfg = GRPOLossConfig(filter_zero_variance=True)
    adv, keep, stats = compute_advantages(rewards, valid, cfg)
    # group 0: rewards {1, 0} -> mean 0.5, sample std sqrt(0.5); group 1 has zero variance.
    assert adv[0].tolist() == pytest.approx([0.5 / math.sqrt(0.5), 0.0, -0.5 / math.sqrt(0.5)])
    assert keep.tolist() == [[True, False, True], [False, False, False]] and stats["zero_variance_groups"] == 1
    mask = torch.ones(6, 2) * keep.reshape(-1, 1)
    lp = torch.zeros(6, 2, requires_grad=True)
    loss, stats = grpo_loss(lp, lp.detach(), None, adv.reshape(-1), mask, cfg)
    m = grpo_metrics(stats, cfg)
    loss.backward()
    assert m["tokens"] == 4.0
    assert lp.grad[0].lt(0).all() and lp.grad[2].gt(0).all() and lp.grad[[1, 3, 4, 5]].eq(0).all()
    with pytest.raises(ValueError, match="group_size=4"):
        rewards_from_scores(scores, group_size=4)


def _uneven_batch(seed=5):
    """B=4 rows of uneven length; row 1 fully masked (a verifier error / filtered group)."""
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2 - 0.1
    logprobs = behavior + 0.3 * (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)
    ref = behavior + 0.3 * (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.2, 0.0, -0.4, 0.9], dtype=torch.float64)
    mask = torch.zeros(4, 6, dtype=torch.float64)
    mask[0, :2] = 1
    mask[2, :6] = 1
    mask[3, 1:4] = 1
    return logprobs, behavior, ref, adv, mask


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_micro_batches_with_global_denominators_give_the_batch_loss(agg):
    # Two micro-batches of 2 (the first holds the masked row).  The learner averages micro-batch
    # losses, so with N/K and S/K the mean must be the documented batch-wide formula, and the
    # summed statistics must give the same metrics as one call on the whole batch.
    lp, mu, ref, adv, mask = _uneven_batch()
    cfg = GRPOLossConfig(aggregation=agg, kl_coef=0.05, clip_eps_low=0.1, clip_eps_high=0.1)
    expected = _loop_loss(lp.tolist(), mu.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                          0.1, 0.1, 0.05, "k2", agg)
    n_tokens, n_seqs, k = float(mask.sum()), float((mask.sum(1) > 0).sum()), 2
    assert (n_tokens, n_seqs) == (11.0, 3.0)
    lp_full = lp.clone().requires_grad_(True)
    full, full_stats = grpo_loss(lp_full, mu, ref, adv, mask, cfg)
    full.backward()
    lp_mb = lp.clone().requires_grad_(True)
    losses, summed = [], {}
    for rows in (slice(0, 2), slice(2, 4)):
        loss, stats = grpo_loss(lp_mb[rows], mu[rows], ref[rows], adv[rows], mask[rows], cfg,
                                token_denominator=n_tokens / k, sequence_denominator=n_seqs / k)
        losses.append(loss)
        for key, v in stats.items():
            if v.dim():  # per-sequence: rows of the batch
                summed[key] = torch.cat([summed[key], v]) if key in summed else v
            else:
                summed[key] = summed.get(key, 0.0) + v
    (sum(losses) / k).backward()
    assert float(full) == pytest.approx(expected, rel=1e-12)
    assert float(sum(losses) / k) == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(lp_mb.grad, lp_full.grad, rtol=0, atol=1e-15)
    got, want = grpo_metrics(summed, cfg), grpo_metrics(full_stats, cfg)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
    assert got["loss"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("policy", ["on", "off"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimator_expected_gradient_matches_its_documented_direction(est, policy):
    # A 3-outcome categorical π_θ = softmax(θ): enumerate the outcomes for the exact expectation
    # E_{x~μ}[∇ loss(x)] of the penalty as grpo_loss differentiates it (μ = π_θ on-policy).
    from megatron_rl.grpo.loss import KL_GRADIENT, kl_metric_name

    theta = torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    ref = torch.log_softmax(torch.tensor([-0.2, 0.7, 0.1], dtype=torch.float64), 0)
    mu = logp.detach() if policy == "on" else torch.log_softmax(torch.tensor([0.8, 0.1, -0.6], dtype=torch.float64), 0)
    cfg = GRPOLossConfig(kl_coef=1.0, kl_estimator=est)
    expected_grad = torch.zeros(3, dtype=torch.float64)
    for x in range(3):
        loss, _ = grpo_loss(logp[x].reshape(1, 1), mu[x].reshape(1, 1), ref[x].reshape(1, 1),
                            torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), cfg)
        expected_grad += mu[x].exp() * torch.autograd.grad(loss, theta, retain_graph=True)[0]
    p, p_ref = logp.exp(), ref.exp()
    kl_theta_ref = (p * (logp - ref)).sum()  # KL(π_θ‖π_ref)
    kl_ref_theta = (p_ref * (ref - logp)).sum()  # KL(π_ref‖π_θ)
    targets = {"theta_ref": torch.autograd.grad(kl_theta_ref, theta, retain_graph=True)[0],
               "ref_theta": torch.autograd.grad(kl_ref_theta, theta, retain_graph=True)[0],
               "none": torch.zeros(3, dtype=torch.float64)}
    assert (targets["theta_ref"] - targets["ref_theta"]).abs().max() > 0.05  # the directions differ here
    assert KL_GRADIENT[est] == {"k1": "none", "k2": "theta_ref", "k3": "ref_theta"}[est]
    torch.testing.assert_close(expected_grad, targets[KL_GRADIENT[est]], rtol=0, atol=1e-12)
    assert kl_metric_name(est) == f"kl_ref_{est}_grad_{KL_GRADIENT[est]}"
    assert KL_GRADIENT[GRPOLossConfig().kl_estimator] == "theta_ref"  # the default descends KL(π_θ‖π_ref)


def test_huge_log_ratios_give_finite_gradients():
    # Token 0: log π_θ - log μ = 149 (exp overflows even float64 past 709, float32 past 88);
    # token 1: log π_ref - log π_θ = 149 (k3's exp).  Clamped at ±20: finite loss and gradients.
    mu = torch.tensor([[-150.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0]])
    for adv in (1.0, -1.0):
        for cfg in (GRPOLossConfig(), GRPOLossConfig(kl_coef=0.1, kl_estimator="k3", tis_cap=2.0),
                    GRPOLossConfig(kl_coef=0.1, kl_estimator="k2", aggregation="sequence")):
            lp = torch.tensor([[-1.0, -150.0]], requires_grad=True)
            loss, stats = grpo_loss(lp, mu, ref, torch.tensor([adv]), torch.ones(1, 2), cfg,
                                    old_logprobs_bt=lp.detach() if cfg.tis_cap else None)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), (adv, cfg, lp.grad)
            assert math.isfinite(grpo_metrics(stats, cfg)["ratio_max"])


def test_entropy_bonus_expected_gradient_ascends_entropy():
    # Exact expectation over a 5-way categorical: sum_a pi(a) * grad loss(a) must equal -beta * grad H.
    theta = torch.tensor([0.3, -1.2, 2.0, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    beta = 0.3
    cfg = GRPOLossConfig(entropy_coef=beta, clip_eps_low=0.2, clip_eps_high=0.2)
    logp = torch.log_softmax(theta, dim=0)
    expected = torch.zeros(())
    for a in range(5):
        lp = logp[a].reshape(1, 1)
        loss, _ = grpo_loss(lp, lp.detach(), None, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), cfg)
        expected = expected + logp[a].exp().detach() * loss
    (grad_loss,) = torch.autograd.grad(expected, theta, retain_graph=True)
    entropy = -(logp.exp() * logp).sum()
    (grad_h,) = torch.autograd.grad(entropy, theta)
    assert torch.allclose(grad_loss, -beta * grad_h, atol=1e-10), (grad_loss, grad_h)
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOLossConfig(entropy_coef=-0.1)


def test_entropy_bonus_decays_linearly_by_learner_step_then_stays():
    from megatron_rl.grpo.step_metrics import grpo_step_weight

    cfg = GRPOLossConfig(entropy_coef=0.1, entropy_coef_final=0.02, entropy_decay_steps=40)
    coefs = [cfg.at_step(s).entropy_coef for s in (0, 10, 20, 40, 41, 1000)]
    assert coefs == pytest.approx([0.1, 0.08, 0.06, 0.02, 0.02, 0.02])
    constant = GRPOLossConfig(entropy_coef=0.1)
    assert constant.at_step(500) is constant
    # The loss at a step is the constant-β_H loss with that step's β_H (the same tensors, the same value).
    lp = torch.tensor([[-0.7, -2.3]], requires_grad=True)
    args = (lp, lp.detach(), None, torch.tensor([0.5]), torch.ones(1, 2))
    at_20, stats = grpo_loss(*args, cfg.at_step(20))
    assert at_20.item() == pytest.approx(grpo_loss(*args, GRPOLossConfig(entropy_coef=0.06))[0].item())
    assert at_20.item() != pytest.approx(grpo_loss(*args, constant)[0].item())
    # and the step's β_H is a metric a person can watch fall
    assert grpo_step_weight(stats, cfg.at_step(20))[1]["entropy_coef"] == pytest.approx(0.06)
    for bad, field in ((dict(entropy_coef_final=0.0), "entropy_decay_steps"),
                       (dict(entropy_decay_steps=10), "entropy_coef_final"),
                       (dict(entropy_coef_final=-1.0, entropy_decay_steps=10), "entropy_coef_final must be >= 0"),
                       (dict(entropy_decay_steps=-1), "entropy_decay_steps must be >= 0")):
        with pytest.raises(ValueError, match=field):
            GRPOLossConfig(entropy_coef=0.1, **bad)
