"""Per-token log-probabilities from (vocab-parallel) logits.

    logprobs_bt = token_logprobs(logits_btv, tokens_bt, vocab_size)   # [B, T-1]

Legend: B sequences, T tokens, V vocabulary columns held by this TP rank (V_padded / tp).
logprobs_bt[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]), normalised over the REAL
vocabulary: Megatron pads the embedding table to a multiple of 128*tp, and those padded
columns are masked to -inf so the distribution equals the HF checkpoint's (and vLLM's).
Differentiable; under TP the softmax normaliser is all-reduced across the TP group.
"""

from __future__ import annotations

import torch


def token_logprobs(logits_btv: torch.Tensor, tokens_bt: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(next token) for every position but the last: [B, T, V/tp] x [B, T] -> [B, T-1]."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    local_v = logits_btv.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local_v
    logits = logits_btv[:, :-1].float()  # [B, T-1, V/tp]
    column_ids = torch.arange(start, start + local_v, device=logits.device)
    if start + local_v > vocab_size:
        # masked_fill returns a fresh tensor; the cross-entropy below edits its input in place.
        logits = logits.masked_fill(column_ids >= vocab_size, float("-inf"))
    else:
        logits = logits.clone()
    targets = tokens_bt[:, 1:].contiguous()  # [B, T-1]
    return -vocab_parallel_cross_entropy(logits, targets)  # [B, T-1]
