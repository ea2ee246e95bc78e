"""GRPO building blocks: group-normalised advantages and the clipped-surrogate loss.

    from megatron_rl.grpo import GRPOLossConfig, compute_advantages, grpo_loss, rewards_from_scores
"""

from megatron_rl.grpo.advantages import group_advantages, rewards_from_scores
from megatron_rl.grpo.loss import GRPOLossConfig, compute_advantages, grpo_loss, kl_estimate
from megatron_rl.grpo.step_metrics import grpo_metrics, grpo_step_weight, lag_guard_weight

__all__ = ["GRPOLossConfig", "compute_advantages", "group_advantages", "grpo_loss", "grpo_metrics",
           "grpo_step_weight", "kl_estimate", "lag_guard_weight", "rewards_from_scores"]
