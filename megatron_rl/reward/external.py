"""Correctness from graders no one here wrote: math-verify and reasoning-gym's own scorers.

    correct = external_correctness("math_verify", response, extracted, reference)   # 0.0 / 1.0
    correct = external_correctness("reasoning_gym", response, extracted, reference)  # in [0, 1]

math-verify (`reward.grader: math_verify`) parses the reference and the whole response (it finds
boxed and final answers itself) and compares them symbolically.  reasoning-gym
(`reward.grader: reasoning_gym`) scores the extracted answer with the generator's own
`score_answer(answer, entry)`; the reference is the task entry as JSON (`Example.reference`:
answer and metadata), since some generators score against their metadata.  Both run inside
the verifier pool's worker processes, under its timeout.
"""

from __future__ import annotations

import functools
import json


def external_correctness(grader: str, response: str, extracted: str | None, reference: str) -> float:
    if grader == "math_verify":
        from math_verify import parse, verify

        gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$")
        return 1.0 if gold and verify(gold, parse(response)) else 0.0
    if grader == "reasoning_gym":
        entry = json.loads(reference)
        if not isinstance(entry, dict) or "answer" not in entry or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError("a reasoning_gym reference must be a task entry (answer + metadata.source_dataset)")
        return float(_scorer(entry["metadata"]["source_dataset"])(extracted, entry))
    raise ValueError(f"unknown grader {grader!r}")


@functools.lru_cache(maxsize=16)
def _scorer(name: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0).score_answer
