"""How a global batch is cut into micro-batches: the rows each data-parallel rank runs, in which
micro-batch, and how wide each micro-batch's grid is.

    plan = plan_micro_batches(lengths, dp=2, micro_batch_size=1, max_tokens=4096)
    plan.ranks[r]        # rank r's micro-batches: [(rows, width), ...], rows = global row indices
    plan.num_micro_batches, plan.padding_fraction

Two modes:

* fixed (`max_tokens` None or 0; what the learner always did): rank r takes the contiguous rows
  [r B/dp, (r+1) B/dp) and cuts them into micro-batches of `micro_batch_size` rows, every one
  as wide as the whole batch (T).
* token budget (`max_tokens` > 0): the rows are sorted by length (longest first) and dealt to
  the ranks so that every rank gets B/dp rows (equal row counts guarantee the step below can
  always succeed) and token counts as even as the greedy rule allows (each row goes to the rank
  with the fewest tokens that still has room).  On each rank the sorted rows are packed into
  micro-batches while (rows x longest) stays within the budget; a row longer than the budget
  is a micro-batch on its own.  Every rank must run the same number K of micro-batches
  (Megatron's schedule and DDP's gradient sync step in lockstep), so ranks with fewer split
  their most expensive micro-batch in two until they have K.  Each micro-batch is only as wide
  as its own longest row.

`lengths` are the real token counts of the rows (prompt + response); positions at or beyond a
row's length are padding and are never computed in budget mode.

The micro-batch denominator (GRPO's and SFT's losses, grpo/micro_loss.py and learner/sft_loss.py):
a micro-batch divides its sum by a global count over the step's K micro-batches (`per_micro_batch`),
so the sum over micro-batches is the batch mean whatever K is.  The learner tells each micro-batch
its K (`num_micro_batches`); a batch also carries the count over fixed micro-batches (`fixed_share`)
for callers outside the learner.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

from megatron_rl.learner.config import batch_problem


@dataclasses.dataclass
class MicroBatchPlan:
    ranks: list[list[tuple[list[int], int]]]
    """Per data-parallel rank, its micro-batches in run order: (global row indices, width)."""
    real_tokens: int
    """Sum of the rows' lengths."""

    @property
    def num_micro_batches(self) -> int:
        """K: micro-batches of the whole step, over all data-parallel ranks (the same count per rank)."""
        return sum(len(r) for r in self.ranks)

    @property
    def grid_tokens(self) -> int:
        """Token positions the learner computes: sum of rows x width over every micro-batch."""
        return sum(len(rows) * width for rank in self.ranks for rows, width in rank)

    @property
    def padding_fraction(self) -> float:
        grid = self.grid_tokens
        return 1.0 - self.real_tokens / grid if grid else 0.0


def plan_micro_batches(lengths: Sequence[int], *, dp: int, micro_batch_size: int,
                       max_tokens: int | None = None, width: int | None = None) -> MicroBatchPlan:
    """The micro-batches of a global batch of len(lengths) rows (see the module docstring).

    `width` is the batch's padded width T (default: the longest length); fixed mode uses it for
    every micro-batch.
    """
    lengths = [int(n) for n in lengths]
    b = len(lengths)
    if b == 0 or dp < 1 or b % dp:
        raise ValueError(f"a batch of {b} rows cannot be split over {dp} data-parallel ranks")
    t = int(width) if width is not None else max(lengths)
    if min(lengths) < 1 or max(lengths) > t:
        raise ValueError(f"row lengths must be within [1, {t}], got [{min(lengths)}, {max(lengths)}]")
    local = b // dp
    if not max_tokens:
        problem = batch_problem(b, micro_batch_size, dp)
        if problem:
            raise ValueError(f"a batch of {problem}")
        ranks = [[(list(range(s, s + micro_batch_size)), t) for s in range(r * local, (r + 1) * local, micro_batch_size)]
                 for r in range(dp)]
        return MicroBatchPlan(ranks, sum(lengths))
    if max_tokens < 0:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 0, got {max_tokens}")

    # Longest first; ties by row index so every rank computes the same plan.
    order = sorted(range(b), key=lambda i: (-lengths[i], i))
    # Deal the rows: fewest tokens first among ranks with room (heap of (tokens, rank)).
    members: list[list[int]] = [[] for _ in range(dp)]
    heap = [(0, r) for r in range(dp)]
    for i in order:
        tokens, r = heapq.heappop(heap)
        while len(members[r]) == local:  # a full rank leaves the heap for good
            tokens, r = heapq.heappop(heap)
        members[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
    ranks = [_pack(rows, lengths, max_tokens) for rows in members]
    k = max(len(r) for r in ranks)
    for micro in ranks:
        while len(micro) < k:
            _split_costliest(micro, lengths)
    return MicroBatchPlan([[(rows, max(lengths[i] for i in rows)) for rows in micro] for micro in ranks],
                          sum(lengths))


def _pack(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Rows sorted longest first -> consecutive groups with len(group) x longest <= budget."""
    groups: list[list[int]] = []
    for i in rows:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _split_costliest(micro: list[list[int]], lengths: list[int]) -> None:
    """Split the micro-batch of most padded tokens (rows x width) among those of 2+ rows in two."""
    candidates = [j for j, rows in enumerate(micro) if len(rows) > 1]
    if not candidates:
        raise AssertionError("no micro-batch left to split (every rank holds B/dp rows, so this cannot happen)")
    j = max(candidates, key=lambda j: (len(micro[j]) * lengths[micro[j][0]], -j))
    rows = micro[j]
    half = (len(rows) + 1) // 2
    micro[j:j + 1] = [rows[:half], rows[half:]]


def per_micro_batch(mb: dict, total: str, fixed: str) -> float:
    """A micro-batch's denominator: the global count `mb[total]` over the K micro-batches of its step
    (`num_micro_batches`, set by the learner; a token budget makes it vary).  Outside the learner (no
    `num_micro_batches`), the batch's precomputed `mb[fixed]` (fixed_share)."""
    k = mb.get("num_micro_batches")
    if k is None:
        return float(mb[fixed])
    if total not in mb:
        raise KeyError(f"a learner micro-batch needs the global {total!r} (train.batch.build_batch and "
                       "train.sft_data.sft_batch provide it)")
    return float(mb[total]) / k


def fixed_share(total: float, rows: int, micro_batch_size: int) -> float:
    """`total` over the K = rows / micro_batch_size fixed micro-batches of a batch of `rows` rows."""
    problem = batch_problem(rows, micro_batch_size)
    if problem:
        raise ValueError(f"a batch of {problem} rows")
    return total / (rows // micro_batch_size)
