"""What the policy checks on tokens the engines sampled: the refit probe's rows, and the reconcile.

    rows = probe_sequences(taken, rows=4)                       # refit probe: sampled, not random, tokens
    stats = reconcile_sampled(learner.forward_logprobs, taken, version, rows=4, tolerance=0.25)

The refit probe (rollout/refit_check.py) compares raw teacher-forced logprobs, so it runs whatever
the sampling transform; its rows are the prompt and response tokens of the last batch learned.

The reconcile (issue 31, item 9): with top-k/top-p on GPU, vLLM samples through its own kernels
(Model Runner V2's Triton top-k/top-p), not the PyTorch semantics the learner reproduces
(learner/logprobs.py).  The engine's behavior logprob of a token it sampled is the truncated
distribution's, so on the tokens of trajectories sampled entirely by the weights the learner holds
now (on-policy), the learner's logprob under the same transform must match it to the serving dtype's
tolerance.  Every step of a truncated-sampling run scores up to `rows` such trajectories and reports
numerics/reconcile_{median,mean,max}_abs and numerics/reconcile_tokens; a median over the
tolerance is logged as a warning and numerics/reconcile_over_tolerance = 1 (a kernel that samples
another distribution than the one the learner optimises; rolling weights back would not fix it).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

import torch

from megatron_rl.learner.sequences import pack_sequences, response_logprobs
from megatron_rl.rollout.refit_check import sampled_probe

__all__ = ["probe_sequences", "on_policy", "reconcile_sampled"]

log = logging.getLogger(__name__)


def probe_sequences(taken: Sequence, rows: int, max_len: int = 64) -> list[list[int]] | None:
    """Refit probe rows [rows][T] from trajectories' prompt + response tokens (None without any)."""
    seqs = [[*map(int, t.prompt_tokens), *map(int, t.response_tokens)] for t in taken]
    return sampled_probe(seqs, rows, max_len)


def on_policy(taken: Sequence, version: int) -> list:
    """Trajectories every token of which the engines sampled with policy version `version`."""
    return [t for t in taken if len(t.response_tokens) and all(int(v) == version for v in t.policy_versions)]


def reconcile_sampled(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], taken: Sequence, version: int,
                      *, rows: int, tolerance: float, pad_id: int = 0) -> dict[str, float]:
    """The learner's logprobs (`forward(tokens_bt, lengths_b)` -> [B, T-1], under the sampling
    transform) against the behavior logprobs on the action tokens of up to `rows` on-policy
    trajectories; {} when there is none.  `rows` rows are always sent (the first repeated), as the
    learner's probe batch needs."""
    chosen = on_policy(taken, version)[:rows]
    if not chosen:
        return {}
    learner_bt = forward(*pack_sequences(chosen, rows, pad_id))  # [rows, width-1]
    deltas: list[float] = []
    for i, t in enumerate(chosen):
        mask = torch.as_tensor(t.action_mask, dtype=torch.bool)
        got = response_logprobs(learner_bt[i], t)[mask]
        want = torch.as_tensor(t.behavior_logprobs, dtype=torch.float32)[mask]
        deltas.extend((got.float() - want).abs().tolist())
    if not deltas:
        return {}
    stats = {"numerics/reconcile_median_abs": statistics.median(deltas),
             "numerics/reconcile_mean_abs": sum(deltas) / len(deltas),
             "numerics/reconcile_max_abs": max(deltas), "numerics/reconcile_tokens": float(len(deltas)),
             "numerics/reconcile_over_tolerance": 0.0}
    if not stats["numerics/reconcile_median_abs"] <= tolerance:
        stats["numerics/reconcile_over_tolerance"] = 1.0
        log.warning("reconcile at version %d: the learner's logprobs of %d sampled tokens differ from the engine's "
                    "by median |Δ| %.3g > %g (mean %.3g, max %.3g): the engine samples another distribution than "
                    "the learner scores (top-k/top-p kernels?)", version, len(deltas),
                    stats["numerics/reconcile_median_abs"], tolerance, stats["numerics/reconcile_mean_abs"],
                    stats["numerics/reconcile_max_abs"])
    return stats
