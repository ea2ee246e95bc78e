"""Supervised fine-tuning as the learner's per-micro-batch loss: the masked tokens' NLL.

    learner.train_step(batch, sft_micro_batch_loss)     # batch from train.sft.sft_batch

Each micro-batch returns its share of the batch-mean NLL (divided by the global batch's masked
tokens over the step's K micro-batches), so the sum over micro-batches is the batch mean.
"""

from __future__ import annotations

import torch

from megatron_rl.learner.micro_batches import per_micro_batch


def sft_micro_batch_loss(logprobs_bt: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
    """Learner loss interface: this micro-batch's share of the batch-mean NLL, additive stats."""
    mask = mb["loss_mask"].to(logprobs_bt.dtype)
    nll = -(logprobs_bt * mask).sum()
    with torch.no_grad():
        stats = {"nll_sum": nll.detach(), "tokens": mask.sum()}
    return nll / per_micro_batch(mb, "tokens_in_loss", "token_denominator"), stats
