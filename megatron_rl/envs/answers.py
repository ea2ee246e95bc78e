"""Final answers of tool-using episodes: extraction and scoring, shared by calculator and python.

    correct = score_final_answer("... Answer: -61", example, ("answer_is", "last_number"))   # 1.0

An example with reasoning-gym metadata is scored by the generator's own scorer
(reward/external.py); a plain example by the project's exact comparison (reward/math_verifier.py).
A scorer that raises propagates: the runner turns it into `env_error`, never a silent zero.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_rl.reward.external import external_correctness
from megatron_rl.reward.math_verifier import EXTRACTORS, answers_match, extract_answer


def check_extractors(extractors: Sequence[str], field: str = "answer_extractors") -> None:
    unknown = [e for e in extractors if e not in EXTRACTORS]
    if not extractors or unknown:
        raise ValueError(f"{field} must be a non-empty list of {list(EXTRACTORS)}, got {list(extractors)}")


def score_final_answer(text: str, example: Any, extractors: Sequence[str]) -> float:
    """Correctness in [0, 1] of the answer found in `text` against `example` (a data Example)."""
    extracted, _ = extract_answer(text, list(extractors))
    if extracted is None:
        return 0.0
    if getattr(example, "metadata", ""):
        return external_correctness("reasoning_gym", text, extracted, example.reference)
    return 1.0 if answers_match(extracted, example.answer) else 0.0
