"""Supervised fine-tuning as the learner's per-micro-batch loss: the masked tokens' NLL.

    batch = sft_rows_batch([(prompt, response, response_mask), ...], pad_id=0, micro_batch_size=4)
    learner.train_step(batch, sft_micro_batch_loss)

Each micro-batch returns its share of the batch-mean NLL (divided by the global batch's masked
tokens over the step's K micro-batches), so the sum over micro-batches is the batch mean.
"""

from __future__ import annotations

import torch

from megatron_rl.learner.micro_batches import fixed_share, per_micro_batch


def sft_rows_batch(rows, *, pad_id: int, micro_batch_size: int) -> dict:
    """The batch SFT's loss reads, from rows (prompt tokens, response tokens, response mask: 1 on the tokens to
    learn).  tokens [B, T] (prompt + response, right-padded), loss_mask [B, T-1] (position k predicts token
    k+1: the mask of the response token it predicts), lengths [B] (real tokens per row), tokens_in_loss N (the
    normaliser; the learner gives each micro-batch its share N/K) and token_denominator, N/K for fixed
    micro-batches of micro_batch_size (for callers outside the learner).  Used by train/sft.py (a prompt and
    its answer) and envs/demonstrations.py (an expert's episode: assistant tokens 1, observations 0)."""
    rows = [([int(t) for t in p], [int(t) for t in r], [float(m) for m in mask]) for p, r, mask in rows]
    if not rows:
        raise ValueError("an SFT batch needs at least one row")
    for p, r, mask in rows:
        if not p or len(mask) != len(r):
            raise ValueError(f"an SFT row needs a prompt and one mask value per response token, got "
                             f"{len(p)} prompt tokens, {len(r)} response tokens, {len(mask)} mask values")
    b, t = len(rows), max(len(p) + len(r) for p, r, _ in rows)
    tokens = torch.full((b, t), int(pad_id), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros(b, t - 1)  # [B, T-1]
    for i, (p, r, mask) in enumerate(rows):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
        loss_mask[i, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(mask)
    n = max(float(loss_mask.sum()), 1.0)
    lengths = torch.tensor([len(p) + len(r) for p, r, _ in rows], dtype=torch.long)  # [B]
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths, "tokens_in_loss": n,
            "token_denominator": fixed_share(n, b, micro_batch_size)}


def sft_micro_batch_loss(logprobs_bt: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
    """Learner loss interface: this micro-batch's share of the batch-mean NLL, additive stats."""
    mask = mb["loss_mask"].to(logprobs_bt.dtype)
    nll = -(logprobs_bt * mask).sum()
    with torch.no_grad():
        stats = {"nll_sum": nll.detach(), "tokens": mask.sum()}
    return nll / per_micro_batch(mb, "tokens_in_loss", "token_denominator"), stats
