"""The reconcile report's gradient-sign check covers every sequence, on the real GRPO loss.

    python -m pytest tests/unit/test_reconcile_sign.py -q

A round of 16 sequences (4 groups of 4, one uniform group) goes through grpo_loss at the
behaviour policy; the sign of dL/dlogp of every masked token must be minus the sign of its
sequence's advantage.  A wrong sign in row 12 (past the 8 rows the table shows) must be caught,
and a round where no sequence carries a sign must not pass.
"""

import pytest
import torch

from megatron_rl.grpo import GRPOLossConfig
from megatron_rl.grpo.loss import grpo_loss
from megatron_rl.train.reconcile import grad_sign_check, nonzero_variance_groups
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit
REWARDS = [1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 1, 1, 1, 0, 0, 0, 1, 0.5]  # group 1 (rows 4-7) is uniform


def round_grads(rewards=REWARDS):
    g = torch.Generator().manual_seed(3)
    b, t = len(rewards), 6
    behavior = -torch.rand(b, t, generator=g, dtype=torch.float64) - 0.1
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, 4)
    adv = (r - r.mean(dim=1, keepdim=True)).flatten()  # GRPO: reward minus its group's mean
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[::3, 4:] = 0
    lp = behavior.clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, behavior, behavior, adv, mask, GRPOLossConfig(kl_coef=0.001))
    loss.backward()
    return lp.grad, mask, adv


def test_every_sequence_is_checked_and_agrees():
    grad, mask, adv = round_grads()
    out = grad_sign_check(grad, mask, adv, [True] * len(adv))
    assert out == {"agrees": True, "checked_sequences": int((adv != 0).sum()), "disagreeing_rows": []}
    assert out["checked_sequences"] > 8


def test_a_wrong_sign_past_the_shown_rows_is_caught():
    grad, mask, adv = round_grads()
    grad[12] = -grad[12]  # deliberately broken: row 12 would be pushed the wrong way
    assert grad_sign_check(grad[:8], mask[:8], adv[:8], [True] * 8)["agrees"]  # the old 8-row check passed
    out = grad_sign_check(grad, mask, adv, [True] * len(adv))
    assert not out["agrees"] and out["disagreeing_rows"] == [12]


def test_a_round_with_nothing_to_check_does_not_pass():
    grad, mask, adv = round_grads([0.5] * 16)  # every group uniform: every advantage 0
    out = grad_sign_check(grad, mask, adv, [True] * 16)
    assert out["checked_sequences"] == 0 and not out["agrees"]


def test_nonzero_variance_groups_counts_groups_with_differing_rewards():
    def traj(i, reward, status="ok"):
        return make_trajectory(id=f"t{i}", prompt_id=f"p{i // 4}", dataset_version="d", policy_versions=0,
                               tokenizer_hash="h", prompt_tokens=[1], response_tokens=[2], behavior_logprobs=[-1.0],
                               reward_components={"r": reward}, grader_version="g", terminal_reason="eos",
                               rollout_started_at=0.0, scored_at=0.0, status=status,
                               error_code="" if status == "ok" else "timeout")
    trajs = [traj(i, r) for i, r in enumerate(REWARDS)]
    assert nonzero_variance_groups(trajs) == 3
    trajs[0] = traj(0, 5.0, status="verifier_timeout")  # out of the loss: group 0 still varies (0, 0, 1)
    assert nonzero_variance_groups(trajs) == 3
    assert nonzero_variance_groups([traj(i, 0.5) for i in range(8)]) == 0
