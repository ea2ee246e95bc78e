"""Built-in verifiable task "digit_max": name the largest of a few digits.

    splits = make_digit_max(seed=0)          # {"train": Dataset, "dev": Dataset, "test": Dataset}
    splits["train"][0]                       # Example(id="digit_max-371", question="max(3,7,1)", answer="7")
    cfg = digit_max_reward_config()          # RewardConfig matching the task's answer format
    tmpl = DIGIT_MAX_TEMPLATE                # prompt "max(3,7,1)=" ; expected response "7"

Why this task.  It is meant for a ~1M-parameter character-level model (one token per
printable ASCII character) trained from random initialisation by GRPO on 2 CPU cores in
~100 steps, and its reward has an easy part and a hard part:

  * format (weight 0.5): the response starts with a number (extractor "leading_number").
    A random policy over ~96 symbols starts with a digit ~10% of the time, so in a group of
    8 samples at least one earns it with probability ~0.57: a dense signal that only asks
    the model to raise the probability of ten output symbols.
  * correctness (weight 1.0): that number equals the maximum digit.  Guessing a random
    digit is right ~10% of the time, always answering "9" is right 1 - 0.9^3 = 27% for three
    digits, and reading the prompt is right 100%: a ladder of partial solutions.

The random policy scores about 0.5*0.1 + 1.0*0.01 ≈ 0.06 mean reward (ceiling 1.5); format
alone lifts it to ≥ 0.5, so a rise of ≥ 0.3 is within reach, and correctness above 0.27 on
the dev/test splits shows the model reads digits rather than memorising prompts.  Keep
responses short at rollout (max 2-4 new tokens, stop at EOS): the answer is one digit.

Splits: all 10^n_digits digit tuples, shuffled by `seed`, then cut into test, dev, train;
the splits are disjoint by construction and identical for the same seed.  The "test" split
is the hidden one: evaluate on it only at the end.
"""

from __future__ import annotations

import itertools
import random

from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.envs.example import Example
from megatron_rl.reward.math_verifier import RewardConfig

TASK_NAME = "digit_max"
DIGIT_MAX_TEMPLATE = PromptTemplate("{question}=")


def make_digit_max(seed: int = 0, *, n_digits: int = 3, dev_size: int = 100, test_size: int = 100) -> dict[str, Dataset]:
    """Deterministic, disjoint train/dev/test splits of the digit_max task."""
    if not 2 <= n_digits <= 5:
        raise ValueError(f"n_digits must be in [2, 5], got {n_digits}")
    total = 10**n_digits
    if dev_size < 1 or test_size < 1 or dev_size + test_size >= total:
        raise ValueError(
            f"dev_size={dev_size} and test_size={test_size} must be >= 1 and leave training examples "
            f"out of {total} for n_digits={n_digits}"
        )
    tuples = list(itertools.product(range(10), repeat=n_digits))
    random.Random(f"{TASK_NAME}:{seed}:{n_digits}").shuffle(tuples)
    cuts = {"test": tuples[:test_size], "dev": tuples[test_size : test_size + dev_size],
            "train": tuples[test_size + dev_size :]}
    return {split: Dataset(name=TASK_NAME, split=split, examples=[_example(t) for t in items])
            for split, items in cuts.items()}


def _example(digits: tuple[int, ...]) -> Example:
    return Example(
        id=f"{TASK_NAME}-{''.join(map(str, digits))}",
        question=f"max({','.join(map(str, digits))})",
        answer=str(max(digits)),
    )


def digit_max_reward_config(**overrides: object) -> RewardConfig:
    """The reward the task is designed for: leading number, format 0.5, correctness 1.0."""
    settings: dict = dict(extractors=["leading_number"], format_extractors=["leading_number"],
                          format_weight=0.5, correctness_weight=1.0)
    settings.update(overrides)
    return RewardConfig(**settings)
