"""The refit check's rule: does a rollout group's freshly loaded policy compute the learner's logprobs?

    tol = refit_tolerance("bfloat16", "auto")              # 0.25: the serving dtype's bound
    verdict = probe_verdict(engine_lps, learner_lps, tol)  # None, or why the load is refused
    tokens_bt = sampled_probe(sequences, rows=4)           # the probe: tokens the engines sampled

After every publication each rollout group scores the probe sequences teacher-forced and compares
with the learner's logprobs of them under the weights it published (rollout/worker.py `_refit_check`,
train/policy.py `_expect_probe`).  What it must catch is a load that verified byte for byte but was
laid out wrongly (a permuted or mis-mapped tensor); what it must let through is two correct
implementations disagreeing in the last bits (TE/cuDNN on the learner, FlashAttention and compiled
kernels in vLLM).

The statistic: the **median** of |Δ logprob| over the probe's tokens.  The probe is made of
**sampled** tokens (the last batch the engines generated) rather than uniformly random ones:
random tokens sit in the log-softmax tail, where a logit's rounding error is not damped by the
token's own probability (Δ log p_t = δz_t - Σ_j p_j δz_j, nearly 0 for p_t near 1 and δz_t - δz_top for a
tail token), and a mean over 15 of them is set by its worst few.  A wrong load moves almost every
token by O(1) nat (a permuted weight matrix makes the sampled tokens improbable), so the median
rises with it; bf16 noise on a few tail tokens does not move the median.

The bound by serving dtype (`TOLERANCE`): max(0.05, K x u) with u the dtype's unit roundoff (2^-24
float32, 2^-11 float16, 2^-8 bfloat16) and K = 64 = 2 sides x 16 (the size of a logit at a sampled
token of a trained LM, in nats) x 2 (the error the hidden states carry into the logits through the
layers, taken as one more rounding of the logits).  So float32 and float16 keep the 0.05 the check
always had, and bfloat16 gets 64 x 2^-8 = 0.25.  For scale, measured on CPU (the setting of
tests/unit/test_refit_check.py: the `small` random qwen2, its LM head scaled x4 to a trained model's
logit range, 4 rows of 28 sampled tokens; one side bf16, the other fp32): sampled tokens median
|Δ| 0.052 (mean 0.17, max 1.9), uniformly random tokens mean 0.37 (the old rule refuses that
correct load 7-fold), one permuted MLP matrix median 22.  The measurement the issue asks for, a
bf16 vLLM engine against a bf16 learner on the `medium` model, has not been made; setting
`run.refit_tolerance` to a number overrides the derived bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

FLOOR = 0.05  # the check's bound for float32 since it exists
K_NATS = 64.0  # nats per unit roundoff: 2 sides x |z| 16 x 2 (see the module doc)
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TOLERANCE = {name: max(FLOOR, K_NATS * u) for name, u in UNIT_ROUNDOFF.items()}
AUTO = "auto"


def refit_tolerance(serving_dtype: str, configured: float | str | None) -> float | None:
    """The bound on the median |Δ logprob|: `configured` when it is a number, the serving dtype's
    (TOLERANCE) for "auto", None (no check) for None."""
    if configured is None or configured != AUTO:
        return None if configured is None else float(configured)
    name = serving_dtype.removeprefix("torch.")
    if name not in TOLERANCE:
        raise ValueError(f"no refit tolerance for serving dtype {serving_dtype!r} (one of {sorted(TOLERANCE)}): "
                         "set run.refit_tolerance to a number")
    return TOLERANCE[name]


def probe_deltas(engine: Sequence[Sequence[float | None]], learner: Sequence[Sequence[float]]) -> list[float]:
    """|Δ| per token: the engine's prompt logprobs per row [T] (the first is None: nothing predicts
    it) against the learner's [T-1]."""
    return [abs(g - e) for g_row, e_row in zip(engine, learner) for g, e in zip(g_row[1:], e_row)]


def probe_verdict(engine, learner, tolerance: float) -> tuple[dict, str | None]:
    """(the statistics, None) when the median |Δ| is within `tolerance`, else (stats, why refused)."""
    deltas = probe_deltas(engine, learner)
    if not deltas:
        return {"tokens": 0}, "refit check: the probe compared no token"
    stats = {"median": statistics.median(deltas), "mean": sum(deltas) / len(deltas), "max": max(deltas),
             "tokens": len(deltas)}
    if stats["median"] <= tolerance:  # also False for NaN
        return stats, None
    return stats, (f"median |Δ| {stats['median']:.3g} > tolerance {tolerance:g} over {len(deltas)} tokens "
                   f"(mean {stats['mean']:.3g}, max {stats['max']:.3g})")


def sampled_probe(sequences: Sequence[Sequence[int]], rows: int, max_len: int = 64) -> list[list[int]] | None:
    """`rows` probe rows of one length from sampled sequences (prompt + response tokens): the last
    tokens of each, as many as the shortest has (at most `max_len`), so a long prompt leaves the
    sampled response in; None when there is none of at least 2 tokens."""
    usable = [list(s) for s in sequences if len(s) >= 2]
    if not usable:
        return None
    chosen = [usable[i % len(usable)] for i in range(rows)]
    length = min(max_len, *(len(s) for s in chosen))
    return [s[len(s) - length:] for s in chosen]
