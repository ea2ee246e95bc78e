"""Shared by the learner equivalence tests: a real one-group learner batch and the batch-wide GRPO
loss written out directly (the formulas megatron_rl.grpo.loss documents), to compare against."""

from __future__ import annotations

import time

import torch


def one_group_batch(responses: list[list[int]], texts: list[str | None], *, micro_batch_size: int) -> dict:
    """A real learner batch (build_batch) of one group after prompt [5, 17, 42]; text None = the
    verifier timed out (the row is masked)."""
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.reward import RewardConfig, Score, score_response
    from megatron_rl.rollout.sample import PromptInfo, RolloutSample
    from megatron_rl.train.batch import build_batch
    from megatron_rl.sampling.scoring import to_trajectories

    reward = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"], format_weight=0.5)
    now = time.time()
    samples = [RolloutSample(prompt_tokens=[5, 17, 42], response_tokens=r, behavior_logprobs=[-1.0] * len(r),
                             policy_versions=[0] * len(r), sampling={"temperature": 1.0}, finish_reason="stop",
                             started_at=now, finished_at=now, prompt=PromptInfo(id="p", round=0, answer="5"))
               for r in responses]
    scores = [score_response(t, "5", reward) if t is not None else Score.failed("timeout", reward.grader_version())
              for t in texts]
    trajs = to_trajectories(samples, scores, tokenizer_hash="h", dataset_version="d")
    batch, _ = build_batch(trajs, pad_id=0, loss_cfg=GRPOLossConfig(), micro_batch_size=micro_batch_size)
    return batch


def documented_loss(logprobs_bt: torch.Tensor, batch: dict, aggregation: str, eps: float = 0.2) -> torch.Tensor:
    """Clipped surrogate over the whole batch at once: token mean, or mean over sequences of
    their token means (masked rows count in neither)."""
    mu, m, adv = batch["behavior_logprobs"], batch["loss_mask"], batch["advantages"][:, None]
    ratio = torch.exp(logprobs_bt - mu)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv) * m
    if aggregation == "token":
        return per_token.sum() / m.sum()
    n = m.sum(dim=1)
    kept = n > 0
    return (per_token.sum(dim=1)[kept] / n[kept]).sum() / kept.sum()
