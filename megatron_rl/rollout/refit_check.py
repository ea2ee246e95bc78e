"""The refit check's rule: does a rollout group's freshly loaded policy compute the learner's logprobs?

    tol = refit_tolerance("bfloat16", "auto", 24)          # 1.92: the serving dtype's bound at 24 layers
    verdict = probe_verdict(engine_lps, learner_lps, tol)  # None, or why the load is refused
    tokens_bt = sampled_probe(sequences, rows=4)           # the probe: tokens the engines sampled

After every publication each rollout group scores the probe sequences teacher-forced and compares
with the learner's logprobs of them under the weights it published (rollout/receiver.py `_refit_check`,
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

The bound by serving dtype and depth, measured (benchmarks/refit_probe_bf16.py, results in
benchmarks/refit_probe_bf16.md): vLLM's CPU engine against a one-rank Megatron learner on random qwen2
models whose LM head is scaled x4 and x8 to a trained model's logit range, 16 rows of 32 sampled tokens,
the check's statistic per 4-row probe.  Both sides float32 (24 layers): median |Δ| 1e-4.  Both sides
bfloat16: worst probe median 0.05 at 2 layers, 0.21 at 8, 0.99 at 24 -- the rounding noise grows with
depth, about 0.04 nat per layer at most -- while a load with one MLP matrix rolled by a row gives 12-90
on sampled tokens (4-27 on random ones, whose correct-load median is 1.5-5x the sampled one's).  So
"auto" is max(FLOOR, PER_LAYER[dtype] x layers): bfloat16 0.08 per layer (twice the worst measured),
float16 8x less (its unit roundoff 2^-11 against 2^-8; not measured), float32 the FLOOR 0.05 it always
had (500x the measured noise).  A 24-layer bf16 model gets 1.92 and Qwen2.5-1.5B (28 layers) 2.24, an
order of magnitude below a wrong load; the bound derived before this measurement (0.25 for any
depth) refused every correct bf16 load of the 24-layer model.  Random models amplify rounding more
than trained ones, so this bound errs on the side of letting a correct load through; setting
`run.refit_tolerance` to a number overrides it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

FLOOR = 0.05  # the check's bound for float32 since it exists
PER_LAYER = {"float32": 0.0, "float16": 0.01, "bfloat16": 0.08}  # nats per transformer layer (module doc)
AUTO = "auto"


def refit_tolerance(serving_dtype: str, configured: float | str | None, num_layers: int = 1) -> float | None:
    """The bound on the median |Δ logprob|: `configured` when it is a number, the serving dtype's for a
    model of `num_layers` transformer layers for "auto" (module doc), None (no check) for None."""
    if configured is None or configured != AUTO:
        return None if configured is None else float(configured)
    name = serving_dtype.removeprefix("torch.")
    if name not in PER_LAYER:
        raise ValueError(f"no refit tolerance for serving dtype {serving_dtype!r} (one of {sorted(PER_LAYER)}): "
                         "set run.refit_tolerance to a number")
    if num_layers < 1:
        raise ValueError(f"refit tolerance for a model of {num_layers} layers: need at least 1")
    return max(FLOOR, PER_LAYER[name] * num_layers)


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
