"""GRPO group-normalised advantages, over the valid members of each group only.

    rewards_ng, valid_ng = rewards_from_scores(scores, group_size=8)   # verifier Scores, group-major
    adv_ng, keep_ng, stats = group_advantages(rewards_ng, valid_ng, eps=1e-6)

Shape legend: N = groups (prompts), G = samples per prompt (group size).

GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2, outcome supervision) scores sample i
of a group against its siblings:

    Â_i = (R_i - mean_j R_j) / max(std_j R_j, ε)

where mean and std run over the group's *valid* members only.  A member is invalid when its
verifier returned an error code (timeout, crash) and therefore no reward: it gets advantage
0 and `keep=False`, so it is neither scored as zero nor counted in the loss.  `std` is the
Bessel-corrected sample std (as in common GRPO implementations).

A group whose valid rewards are all equal (or that has fewer than 2 valid members) carries
no learning signal: every Â is 0.  Such zero-variance groups are counted; with
`filter_zero_variance=True` their members are also dropped (`keep=False`), which matters
for token-level aggregation because dropped tokens leave the denominator (DAPO's "dynamic
sampling" filter, Yu et al. 2025, sec. 3.2).

`batch_advantages` is the alternative baseline (loss.advantage_baseline: batch): REINFORCE++
(Hu 2025, eq. 7) normalises over the whole batch instead of the group,

    Â_i = (R_i - mean_batch R) / max(std_batch R, ε)

The baseline still does not depend on the sampled action, so the policy gradient stays
unbiased; what changes is that a group whose samples all failed is pushed away from what it
sampled (and a group that all succeeded towards it) instead of carrying no signal.  On a task
where the policy sharpens onto one wrong answer per prompt, the group baseline leaves exactly
those prompts without gradient, and the batch baseline is what can still move them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def rewards_from_scores(scores: Sequence[Any], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifier scores (objects with .reward, None on error), group-major -> (rewards_ng, valid_ng).

    rewards_ng [N, G] float32 with NaN where the grader failed; valid_ng [N, G] bool.
    """
    if group_size < 1 or len(scores) % group_size:
        raise ValueError(f"{len(scores)} scores do not split into groups of group_size={group_size}")
    values = [float("nan") if s.reward is None else float(s.reward) for s in scores]
    rewards_ng = torch.tensor(values, dtype=torch.float32).view(-1, group_size)
    return rewards_ng, ~torch.isnan(rewards_ng)


def group_advantages(
    rewards_ng: torch.Tensor,
    valid_ng: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    filter_zero_variance: bool = False,
    zero_variance_tol: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Group-normalised advantages.

    rewards_ng: [N, G] float; entries of invalid members are ignored (may be NaN).
    valid_ng:   [N, G] bool, False where the verifier returned an error code; None = all valid.
    Returns (adv_ng [N, G] float, keep_ng [N, G] bool, stats) where stats has
    `groups`, `zero_variance_groups`, `invalid_samples`, `kept_samples`.
    """
    if rewards_ng.dim() != 2:
        raise ValueError(f"rewards_ng must be [N, G], got shape {tuple(rewards_ng.shape)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if valid_ng is None:
        valid_ng = torch.ones_like(rewards_ng, dtype=torch.bool)
    if valid_ng.shape != rewards_ng.shape:
        raise ValueError(f"valid_ng shape {tuple(valid_ng.shape)} != rewards_ng shape {tuple(rewards_ng.shape)}")
    valid_ng = valid_ng.bool()
    if torch.isnan(rewards_ng[valid_ng]).any():
        raise ValueError("a valid sample has a NaN reward; mark it invalid instead")

    rewards = torch.where(valid_ng, rewards_ng.double(), torch.zeros((), dtype=torch.float64))
    count_n = valid_ng.sum(dim=1)  # [N]
    denom_n = count_n.clamp(min=1).double()
    mean_n = rewards.sum(dim=1) / denom_n  # [N]
    dev_ng = torch.where(valid_ng, rewards - mean_n[:, None], torch.zeros((), dtype=torch.float64))
    var_n = (dev_ng**2).sum(dim=1) / (count_n - 1).clamp(min=1).double()  # Bessel
    std_n = var_n.sqrt()
    zero_var_n = (count_n < 2) | (std_n <= zero_variance_tol)  # [N]

    adv_ng = dev_ng / std_n.clamp(min=eps)[:, None]
    adv_ng = torch.where(zero_var_n[:, None], torch.zeros_like(adv_ng), adv_ng)
    keep_ng = valid_ng.clone()
    if filter_zero_variance:
        keep_ng &= ~zero_var_n[:, None]
    stats = {
        "groups": float(rewards_ng.shape[0]),
        "zero_variance_groups": float(zero_var_n.sum()),
        "invalid_samples": float((~valid_ng).sum()),
        "kept_samples": float(keep_ng.sum()),
    }
    return adv_ng.to(rewards_ng.dtype if rewards_ng.is_floating_point() else torch.float32), keep_ng, stats


def batch_advantages(rewards_ng: torch.Tensor, valid_ng: torch.Tensor | None = None, *, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Batch-normalised advantages (REINFORCE++): the same inputs, outputs and stats as
    `group_advantages`; zero-variance groups are counted but keep their (batch) advantages."""
    _, keep_ng, stats = group_advantages(rewards_ng, valid_ng, eps=eps)
    values = rewards_ng.double()[keep_ng]
    if values.numel() < 2:
        return torch.zeros_like(rewards_ng, dtype=torch.float32), keep_ng, stats
    mean, std = values.mean(), values.std()  # Bessel, as in the group form
    adv_ng = torch.where(keep_ng, (rewards_ng.double() - mean) / std.clamp(min=eps), torch.zeros((), dtype=torch.float64))
    if std <= 1e-8:
        adv_ng = torch.zeros_like(adv_ng)
    return adv_ng.to(rewards_ng.dtype if rewards_ng.is_floating_point() else torch.float32), keep_ng, stats
