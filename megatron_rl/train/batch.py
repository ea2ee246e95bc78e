"""From scored trajectories to the learner's global batch: tokens, masks, logprobs, advantages.

    batch, stats = build_batch(trajs, pad_id=0, loss_cfg=cfg.loss, micro_batch_size=1)

Shape legend: B = trajectories in the batch, T = longest prompt+response, N = groups, G =
group size.  The learner predicts token t+1 from tokens[:t+1], so every per-token tensor lives
on the [B, T-1] grid of predictions: response token k of a trajectory whose prompt has P
tokens is predicted at position P + k - 1.

GRPO groups are the trajectories that share `group_key(traj)` (one prompt, one rollout
round).  Advantages are normalised within each group over its valid members only (a verifier
timeout is excluded, never scored as zero): see megatron_rl.grpo.advantages.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from megatron_rl.grpo.loss import compute_advantages
from megatron_rl.learner.micro_batches import fixed_share
from megatron_rl.trajectory import Trajectory


def group_key(traj: Trajectory) -> str:
    """Trajectory ids are '<round>/<prompt_id>/<sample>'; the group is '<round>/<prompt_id>'."""
    return traj.id.rsplit("/", 1)[0]


def _token_grid(trajs: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T], and the action mask and behavior logprobs on the [B, T-1] prediction grid."""
    b = len(trajs)
    t = max(tr.num_tokens for tr in trajs)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(b, t - 1)  # [B, T-1]
    behavior = torch.zeros(b, t - 1)  # [B, T-1]
    for i, tr in enumerate(trajs):
        p, r = len(tr.prompt_tokens), len(tr.response_tokens)
        tokens[i, :p] = torch.from_numpy(tr.prompt_tokens.astype(np.int64))
        tokens[i, p:p + r] = torch.from_numpy(tr.response_tokens.astype(np.int64))
        mask[i, p - 1:p - 1 + r] = torch.from_numpy(tr.action_mask.astype(np.float32))
        behavior[i, p - 1:p - 1 + r] = torch.from_numpy(tr.behavior_logprobs.astype(np.float32))
    return tokens, mask, behavior


def _groups(trajs: Sequence[Trajectory]) -> OrderedDict[str, list[int]]:
    """Group key -> the batch rows of its trajectories, in batch order."""
    groups: OrderedDict[str, list[int]] = OrderedDict()
    for i, tr in enumerate(trajs):
        groups.setdefault(group_key(tr), []).append(i)
    return groups


def _group_rewards(trajs: Sequence[Trajectory], groups: OrderedDict[str, list[int]]):
    """rewards [N, G] (NaN where no valid sample) and which entries are valid samples."""
    g_max = max(len(v) for v in groups.values())
    rewards = torch.full((len(groups), g_max), float("nan"), dtype=torch.float64)  # [N, G]
    valid = torch.zeros(len(groups), g_max, dtype=torch.bool)  # [N, G]
    for n, members in enumerate(groups.values()):
        for g, i in enumerate(members):
            if trajs[i].in_loss:
                rewards[n, g] = trajs[i].reward
                valid[n, g] = True
    return rewards, valid


def build_batch(trajs: Sequence[Trajectory], *, pad_id: int, loss_cfg, micro_batch_size: int):
    """Learner batch (global, every rank gets the same) and advantage statistics."""
    if not trajs:
        raise ValueError("cannot build a batch from zero trajectories")
    b = len(trajs)
    tokens, mask, behavior = _token_grid(trajs, pad_id)
    groups = _groups(trajs)
    rewards, valid = _group_rewards(trajs, groups)
    adv_ng, keep_ng, stats = compute_advantages(rewards, valid, loss_cfg)
    advantages = torch.zeros(b)  # [B]
    for n, members in enumerate(groups.values()):
        for g, i in enumerate(members):
            advantages[i] = adv_ng[n, g]
            if not keep_ng[n, g]:
                mask[i] = 0.0  # excluded from the loss: verifier error or filtered group
    total_tokens = float(mask.sum())
    total_sequences = float((mask.sum(dim=1) > 0).sum())
    informative_tokens = float(mask[advantages != 0].sum())
    # Global normalisers (megatron_rl.grpo.loss, "Aggregation"): the learner averages the K
    # micro-batch losses of the whole batch (Megatron's schedule over a rank's micro-batches,
    # DDP over data-parallel ranks), so a micro-batch divides its sum by N/K (token) or S/K
    # (sequence) and the average is sum / N or sum of per-sequence means / S, exactly.  N and S
    # travel as they are; the learner tells each micro-batch the K of its step
    # (`num_micro_batches`, which a token budget makes vary).  The *_denominator entries are N/K
    # and S/K for fixed micro-batches of micro_batch_size, for callers outside the learner.
    batch = {
        "tokens": tokens,
        "loss_mask": mask,
        "behavior_logprobs": behavior,
        "advantages": advantages,
        "lengths": torch.tensor([tr.num_tokens for tr in trajs], dtype=torch.long),  # [B] real tokens per row
        "tokens_in_loss": max(total_tokens, 1.0),
        "sequences_in_loss": max(total_sequences, 1.0),
        "token_denominator": fixed_share(max(total_tokens, 1.0), b, micro_batch_size),
        "sequence_denominator": fixed_share(max(total_sequences, 1.0), b, micro_batch_size),
    }
    # Groups of unequal size are padded in the [N, G] matrix; count real samples only.
    stats["invalid_samples"] = float(sum(not t.in_loss for t in trajs))
    stats.update(tokens_in_loss=total_tokens, sequences_in_loss=total_sequences,
                 informative_tokens=informative_tokens, sequences=float(b))
    return batch, stats
