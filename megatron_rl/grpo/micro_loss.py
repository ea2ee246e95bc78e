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


def micro_batch_denominators(mb: dict) -> tuple[float, float]:
    """(N/K, S/K) of a micro-batch: the global batch's tokens N and sequences S in the loss
    (`tokens_in_loss`, `sequences_in_loss`) over the K micro-batches of its step
    (`num_micro_batches`, set by the learner; it varies with a token budget).  Outside the learner
    (no `num_micro_batches`) the batch's precomputed *_denominator entries are used."""
    k = mb.get("num_micro_batches")
    if k is None:
        return float(mb["token_denominator"]), float(mb["sequence_denominator"])
    if "tokens_in_loss" not in mb or "sequences_in_loss" not in mb:
        raise KeyError("a learner micro-batch needs the global 'tokens_in_loss' and 'sequences_in_loss' "
                       "(train.batch.build_batch provides them)")
    return float(mb["tokens_in_loss"]) / k, float(mb["sequences_in_loss"]) / k


def grpo_micro_batch_loss(logprobs_bt: torch.Tensor, mb: dict, cfg):
    """The learner's loss_fn: GRPO on one micro-batch, normalised as the module docstring says."""
    token_den, seq_den = micro_batch_denominators(mb)
    return grpo_loss(
        logprobs_bt, mb["behavior_logprobs"], mb.get("ref_logprobs"), mb["advantages"], mb["loss_mask"], cfg,
        old_logprobs_bt=logprobs_bt.detach() if cfg.tis_cap is not None else None,
        token_denominator=token_den,
        sequence_denominator=seq_den,
    )
