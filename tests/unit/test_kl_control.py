"""The adaptive KL controller (grpo/kl_control.py): its rule, its closed loop, its state, its config."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from megatron_rl.grpo.kl_control import ERROR_CLIP, KLController
from megatron_rl.grpo.loss_config import GRPOLossConfig

REPO = Path(__file__).resolve().parents[2]


def adaptive(coef=0.1, target=0.5, horizon=10) -> KLController:
    return KLController(GRPOLossConfig(kl_coef=coef, kl_control="adaptive", kl_target=target, kl_horizon=horizon))


def test_one_update_is_proportional_to_the_relative_error_and_clipped():
    kl = adaptive()
    assert kl.update(0.5) == pytest.approx(0.1)                   # on target: β stays
    assert kl.update(0.45) == pytest.approx(0.1 * (1 - 0.1 / 10))  # 10% below: β down by 1%
    kl = adaptive()
    assert kl.update(50.0) == pytest.approx(0.1 * (1 + ERROR_CLIP / 10))  # far above: the clip
    kl = adaptive()
    assert kl.update(0.0) == pytest.approx(0.1 * (1 - ERROR_CLIP / 10))   # no drift at all: the clip below


def test_a_step_that_measured_nothing_leaves_beta_alone():
    kl = adaptive()
    for measured in (None, float("nan"), float("inf")):
        assert kl.update(measured) == 0.1


def test_fixed_control_never_moves():
    kl = KLController(GRPOLossConfig(kl_coef=0.1))
    assert not kl.adaptive
    assert [kl.update(m) for m in (0.0, 5.0, 50.0)] == [0.1, 0.1, 0.1]


def test_the_closed_loop_settles_at_the_target():
    """A plant whose KL falls as β rises (KL = c / β): the controller brings KL to the target from either side."""
    for start in (0.01, 10.0):
        kl = adaptive(coef=start, target=0.5, horizon=5)
        measured = []
        for _ in range(400):
            measured.append(0.2 / kl.coef)
            kl.update(measured[-1])
        assert measured[-1] == pytest.approx(0.5, rel=0.02), (start, measured[-5:])
        assert kl.coef == pytest.approx(0.2 / 0.5, rel=0.02)


def test_beta_moves_at_most_by_the_clip_per_step_and_stays_positive():
    kl = adaptive(coef=1e-3, horizon=1)
    for measured in [0.0] * 50 + [1e6] * 50:
        before = kl.coef
        kl.update(measured)
        assert kl.coef > 0 and abs(kl.coef / before - 1) <= ERROR_CLIP + 1e-12


def test_the_state_continues_an_adaptive_run_and_nothing_else():
    kl = adaptive()
    kl.update(5.0)
    state = kl.state_dict()
    again = adaptive()
    again.load_state_dict(state)
    assert again.coef == kl.coef != 0.1
    fresh = adaptive()
    fresh.load_state_dict(None)                                    # a checkpoint from before the controller
    assert fresh.coef == 0.1
    fresh.load_state_dict({"control": "fixed", "coef": 0.7})       # a fixed run's: not this controller's β
    assert fresh.coef == 0.1
    fixed = KLController(GRPOLossConfig(kl_coef=0.1))
    fixed.load_state_dict(state)                                   # a fixed run ignores an adaptive β
    assert fixed.coef == 0.1
    with pytest.raises(ValueError, match="not a positive number"):
        adaptive().load_state_dict({"control": "adaptive", "coef": -1.0})
    with pytest.raises(ValueError, match="not a positive number"):
        adaptive().load_state_dict({"control": "adaptive", "coef": math.nan})


@pytest.mark.parametrize("overrides, problem", [
    (["loss.kl_control=adaptive"], "needs kl_target > 0"),
    (["loss.kl_control=adaptive", "loss.kl_target=0.5", "loss.kl_coef=0"], "kl_coef must be > 0"),
    (["loss.kl_control=adaptive", "loss.kl_target=-1"], "needs kl_target > 0"),
    (["loss.kl_control=adaptive", "loss.kl_target=0.5", "loss.kl_horizon=0"], "kl_horizon must be an int >= 1"),
    (["loss.kl_target=0.5"], "applies to kl_control 'adaptive' only"),
    (["loss.kl_control=pid"], "kl_control"),
])
def test_bad_kl_control_settings_are_refused_by_name(overrides, problem):
    from megatron_rl.train.config import load_train_config

    with pytest.raises(Exception, match=problem) as err:
        load_train_config(str(REPO / "configs" / "tiny_cpu.yaml"), overrides)
    assert "loss" in str(err.value)


def test_sft_drops_the_kl_penalty_of_an_adaptive_config():
    cfg = GRPOLossConfig(kl_coef=0.1, kl_control="adaptive", kl_target=0.5).without_kl()
    assert (cfg.kl_coef, cfg.kl_control, cfg.kl_target) == (0.0, "fixed", None)


def test_the_step_metrics_report_the_beta_the_step_used():
    import torch

    from megatron_rl.grpo.loss import grpo_loss
    from megatron_rl.grpo.step_metrics import grpo_metrics

    torch.manual_seed(0)
    lp, mu, ref = torch.randn(2, 5) * 0.1 - 2, torch.randn(2, 5) * 0.1 - 2, torch.randn(2, 5) * 0.1 - 2
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 5)
    out = {}
    for beta in (0.1, 0.3):
        cfg = GRPOLossConfig(kl_coef=beta)
        _, stats = grpo_loss(lp, mu, ref, adv, mask, cfg)
        out[beta] = grpo_metrics(stats, cfg)
        assert out[beta]["kl_coef"] == beta
    kl = out[0.1][[k for k in out[0.1] if k.startswith("kl_ref_k")][0]]
    assert out[0.3]["loss"] - out[0.1]["loss"] == pytest.approx(0.2 * kl)  # the β in the loss is the one reported
    assert "kl_coef" not in grpo_metrics(grpo_loss(lp, mu, None, adv, mask, GRPOLossConfig())[1], GRPOLossConfig())


def test_kl_measure_scores_the_reference_without_adding_a_penalty():
    from megatron_rl.train.config import load_train_config

    import torch

    from megatron_rl.grpo.loss import grpo_loss
    from megatron_rl.grpo.step_metrics import grpo_metrics

    cfg = load_train_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["loss.kl_coef=0", "loss.kl_measure=true"]).loss
    assert cfg.kl_measure and cfg.has_reference
    assert not GRPOLossConfig().has_reference and GRPOLossConfig(kl_coef=0.1).has_reference
    assert not cfg.without_kl().has_reference  # SFT's learner loads no reference
    torch.manual_seed(1)
    lp, mu, ref = (torch.randn(2, 5) * 0.3 - 2 for _ in range(3))
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 5)
    measured = grpo_metrics(grpo_loss(lp, mu, ref, adv, mask, cfg)[1], cfg)
    plain = grpo_metrics(grpo_loss(lp, mu, None, adv, mask, cfg)[1], cfg)
    rho = (lp - mu).exp()  # tokens were sampled by μ: k3 weighted by π_θ/μ, a token mean
    exact = (rho * ((ref - lp).exp() - (ref - lp) - 1)).mean().item()
    assert measured["kl_ref_estimate"] == pytest.approx(exact, rel=1e-5) and measured["kl_ref_estimate"] > 0
    assert measured["loss"] == pytest.approx(plain["loss"]) == pytest.approx(measured["pg_loss"])
    assert "kl_coef" not in measured and "kl_ref_estimate" not in plain
    with pytest.raises(Exception, match="loss.kl_measure"):
        load_train_config(str(REPO / "configs" / "tiny_cpu.yaml"), ["loss.kl_measure=3"])
