"""A learner forward's rows out of trajectories, and each response's slice of the logprobs it returns.

    tokens_bt, lengths_b = pack_sequences(trajs, rows=4, pad_id=0)   # [rows, T], [rows]
    logprobs_bt = learner.forward_logprobs(tokens_bt, lengths_b)      # [rows, T-1]
    got_r = response_logprobs(logprobs_bt[i], trajs[i])               # [R]: trajs[i]'s response tokens

Legend: B = rows sequences, T the longest prompt + response, R a response's tokens.  A trajectory is
anything with `prompt_tokens` and `response_tokens` (megatron_rl/trajectory.py).  Used by the refit
probe's reconcile (train/probe.py) and the audit's re-score (audit/rescore.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_sequences(trajs: Sequence, rows: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_bt [rows, T], lengths_b [rows]): each trajectory's prompt + response tokens, right-padded;
    `rows` rows are always sent (the trajectories repeated), as the learner's batch plan needs a multiple
    of micro_batch_size x data-parallel size."""
    batch = [trajs[i % len(trajs)] for i in range(rows)]
    width = max(len(t.prompt_tokens) + len(t.response_tokens) for t in batch)
    tokens_bt = torch.full((rows, width), pad_id, dtype=torch.long)
    lengths_b = torch.zeros(rows, dtype=torch.long)
    for i, t in enumerate(batch):
        seq = torch.as_tensor([*map(int, t.prompt_tokens), *map(int, t.response_tokens)], dtype=torch.long)
        tokens_bt[i, :len(seq)], lengths_b[i] = seq, len(seq)
    return tokens_bt, lengths_b


def response_logprobs(logprobs_t: torch.Tensor, traj) -> torch.Tensor:
    """[R]: the logprobs of `traj`'s response tokens out of its row of a forward's [T-1] logprobs."""
    start = len(traj.prompt_tokens) - 1  # position predicting the first response token
    return logprobs_t[start:start + len(traj.response_tokens)]
