"""GRPO as the learner's per-micro-batch loss (megatron_rl.learner's loss interface).

    loss_fn = partial(grpo_micro_batch_loss, cfg=loss_cfg.at_step(step))
    learner.train_step(batch, loss_fn)

A micro-batch of a batch from train.batch.build_batch is normalised by the *global* batch's token
and sequence counts over the step's K micro-batches (micro_batch_denominators), so the sum over
micro-batches is the batch loss whatever K is (K varies under a token budget).
"""

from __future__ import annotations

import torch

from megatron_rl.grpo.loss import grpo_loss
from megatron_rl.learner.micro_batches import per_micro_batch


def micro_batch_denominators(mb: dict) -> tuple[float, float]:
    """(N/K, S/K) of a micro-batch: the global batch's tokens N and sequences S in the loss
    (`tokens_in_loss`, `sequences_in_loss`) over the K micro-batches of its step (the rule:
    learner/micro_batches.py `per_micro_batch`)."""
    return (per_micro_batch(mb, "tokens_in_loss", "token_denominator"),
            per_micro_batch(mb, "sequences_in_loss", "sequence_denominator"))


def grpo_micro_batch_loss(logprobs_bt: torch.Tensor, mb: dict, cfg):
    """The learner's loss_fn: GRPO on one micro-batch, normalised as the module docstring says."""
    token_den, seq_den = micro_batch_denominators(mb)
    return grpo_loss(
        logprobs_bt, mb["behavior_logprobs"], mb.get("ref_logprobs"), mb["advantages"], mb["loss_mask"], cfg,
        old_logprobs_bt=logprobs_bt.detach() if cfg.needs_old_logprobs else None,
        token_denominator=token_den,
        sequence_denominator=seq_den,
    )
