"""Teacher-forced logprobs of trajectories' responses under the weights of each version their segments
name, one scoring call per version and `rows` trajectories, and the audit of them (audit/compare.py).

    report = audit_trajectories(trajs, score, versions={3, 4}, rows=16, multiple=2, mode="recompute", tolerance=1e-3)
    # score(version, tokens_bt [n, T], lengths_b [n]) -> [n, T-1] logprobs under the sampling transform, n <= rows
    # trajectories padded to a multiple of `multiple` (the learner's data-parallel size; default: rows)

`score` is the learner's forward under a version's weights: the learner group's host ring in training
(audit/ring.py, LearnerGroup.audit_logprobs), a one-rank learner loaded from a checkpoint offline
(audit/offline.py, for `megatron-rl audit`: audit_cli.py).  Rows are packed and read back by the same helpers as the sampled reconcile
(learner/sequences.py pack_sequences, response_logprobs).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from megatron_rl.audit.compare import AuditReport, segment_deltas
from megatron_rl.learner.sequences import pack_sequences, response_logprobs

Score = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def rescore(trajs: Sequence, score: Score, versions: Iterable[int], *, rows: int, multiple: int | None = None,
            pad_id: int = 0) -> dict[str, dict[int, np.ndarray]]:
    """{trajectory id: {version: logprobs of its response tokens under that version, float [R]}} for
    every version in `versions` that one of a trajectory's segments names.  A call scores at most `rows`
    trajectories, padded (repeated) to a multiple of `multiple` (default `rows`: every call is `rows` rows)."""
    step = multiple or rows
    out: dict[str, dict[int, np.ndarray]] = {t.id: {} for t in trajs}
    for version in sorted(set(versions)):
        named = [t for t in trajs if any(seg[2] == version for seg in t.segments)]
        for first in range(0, len(named), rows):
            chunk = named[first:first + rows]
            padded = -(-len(chunk) // step) * step
            logprobs_bt = score(version, *pack_sequences(chunk, padded, pad_id))  # [padded, T-1]
            for i, t in enumerate(chunk):
                out[t.id][version] = response_logprobs(logprobs_bt[i], t).float().numpy().astype(np.float64)
    return out


def audit_trajectories(trajs: Sequence, score: Score, versions: Iterable[int], *, rows: int, mode: str,
                       tolerance: float, pad_id: int = 0, multiple: int | None = None) -> AuditReport:
    """Re-score `trajs` under every available version (`versions`) their segments name and judge them."""
    rescored = rescore(trajs, score, versions, rows=rows, multiple=multiple, pad_id=pad_id)
    return AuditReport([row for t in trajs for row in segment_deltas(t, rescored[t.id], mode)], tolerance)
