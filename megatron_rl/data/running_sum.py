"""Built-in reasoning task "running_sum": add up a list of digits, writing the running total.

    splits = make_running_sum(seed=0)   # {"train", "dev", "test"}: Datasets
    splits["test"][0]                   # Example(question="a3b7c1d4", answer="15", solution="a3b10c11d15")
    RUNNING_SUM_TEMPLATE                # prompt "a3b7c1d4=" ; expected response "a3b10c11d15", then EOS

Why this task.  digit_max (builtin.py) is solved by every GRPO arm from its SFT start: its answer is one
token, so arms cannot differ and length cannot drift.  Here the response reasons before it answers.  Each
digit of the prompt carries a letter (a, b, c, ...); the response repeats the letter and writes the total so
far, and its last number is the answer (reward extractor `last_number`).  For a tiny character model:

  * every step is local: after the letter it finds that letter in the prompt (one attention hop, what a
    2-layer model can learn) and adds the digit after it to the number it wrote last;
  * errors compound: a list of n digits is right only if all n steps are, so a short SFT makes a policy that
    is right on short lists and wrong on long ones (a baseline far from the ceiling), and RL that makes each
    step more reliable moves correctness a long way;
  * lengths vary: 1 to 14 digits give responses of 2 to ~40 tokens (a 1-digit list: "a7"), so length can
    drift both ways (dropping the steps and writing only the answer is also rewarded when right).

Totals modulo 10 (one digit a step, a 10 x 10 table) were tried first and are harder for the tiny model, not
easier: 1,500 SFT steps stay at 0.9 nats/token and lists of 3 digits or more at chance.

Splits: lists drawn by `seed`, lengths uniform in [min_digits, max_digits], each split drawn independently
(a list may repeat within one, as a generator's draws do); test and dev first, and no list of 3 or more digits
in them is ever drawn for train.  Lists of 1-2 digits (110 in all) are too few to hold out: every split has
them, so the held-out correctness of the shortest lists measures skill and recall alike.  The "test" split is
the hidden one.
"""

from __future__ import annotations

import random
import re
import string

from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.envs.example import Example
from megatron_rl.reward.math_verifier import answers_match, extract_answer

TASK_NAME = "running_sum"
RUNNING_SUM_TEMPLATE = PromptTemplate("{question}=")
MAX_DIGITS = len(string.ascii_lowercase)
SHARED_BELOW = 3
"""Lists shorter than this (110 of them for 1-2 digits) are too few to split: every split draws from them all."""


def make_running_sum(seed: int = 0, *, min_digits: int = 1, max_digits: int = 14, train_size: int = 20000,
                     dev_size: int = 200, test_size: int = 200, carry_slip: float = 0.0,
                     slip_from: int = 1) -> dict[str, Dataset]:
    """Deterministic train/dev/test splits of the running_sum task, held-out lists of SHARED_BELOW digits or
    more never in train.  `carry_slip`: the train split's worked solutions (SFT's targets) come from a careless
    teacher who, at each step that adds a digit of `slip_from` or more and carries into the tens, drops the
    carry with this probability and goes on from the wrong total (module docstring); answers, and every
    held-out split, stay right."""
    if not 0.0 <= carry_slip < 1.0:
        raise ValueError(f"carry_slip must be in [0, 1), got {carry_slip}")
    if not 1 <= slip_from <= 9:
        raise ValueError(f"slip_from must be a digit in 1-9, got {slip_from}")
    if not 1 <= min_digits <= max_digits <= MAX_DIGITS:
        raise ValueError(f"need 1 <= min_digits <= max_digits <= {MAX_DIGITS}, got {min_digits}, {max_digits}")
    if min(train_size, dev_size, test_size) < 1:
        raise ValueError(f"split sizes must be >= 1, got train {train_size}, dev {dev_size}, test {test_size}")
    if max_digits < SHARED_BELOW:
        raise ValueError(f"max_digits {max_digits}: lists of fewer than {SHARED_BELOW} digits are too few to hold "
                         f"out; at least one length >= {SHARED_BELOW} is needed")
    rng = random.Random(f"{TASK_NAME}:{seed}:{min_digits}:{max_digits}")
    held: set[tuple[int, ...]] = set()
    teacher = random.Random(f"{TASK_NAME}:{seed}:teacher")  # draws only for train's solutions (carry_slip)
    splits = {}
    for split, size in (("test", test_size), ("dev", dev_size), ("train", train_size)):
        drawn = [_draw(rng, min_digits, max_digits, held) for _ in range(size)]
        if split != "train":
            held.update(d for d in drawn if len(d) >= SHARED_BELOW)
        slip = carry_slip if split == "train" else 0.0
        splits[split] = Dataset(name=TASK_NAME, split=split, examples=[
            running_sum_example(d, f"{TASK_NAME}-{split}{i}", slip=slip, slip_from=slip_from, rng=teacher)
            for i, d in enumerate(drawn)])
    return splits


def _draw(rng: random.Random, min_digits: int, max_digits: int, held: set) -> tuple[int, ...]:
    """A list of uniformly drawn length and digits, not one of `held` (a held-out list)."""
    while True:
        digits = tuple(rng.randrange(10) for _ in range(rng.randint(min_digits, max_digits)))
        if digits not in held:
            return digits


def running_sum_example(digits: tuple[int, ...], prefix: str = TASK_NAME, *, slip: float = 0.0, slip_from: int = 1,
                        rng: random.Random | None = None) -> Example:
    """One list: its lettered prompt, its total and the worked solution (letter, total so far; per digit).
    With `slip` > 0 the solution is a careless teacher's: a step that adds a digit of `slip_from` or more and
    carries into the tens drops the carry with probability `slip` (drawn from `rng`), and the steps after it
    add to the wrong total.  The answer is the true total whatever the solution says."""
    letters = string.ascii_lowercase
    written, steps = 0, []
    for letter, d in zip(letters, digits):
        carries = d >= slip_from and written % 10 + d >= 10
        written += d - (10 if carries and slip and rng.random() < slip else 0)
        steps.append(f"{letter}{written}")
    return Example(id=f"{prefix}-{''.join(map(str, digits))}",
                   question="".join(f"{letter}{d}" for letter, d in zip(letters, digits)),
                   answer=str(sum(digits)), solution="".join(steps))


def running_sum_reward(*, prompt: str, response: str, answer: str, question: str, **_: object) -> dict[str, float]:
    """A denser reward for the task (reward.function "megatron_rl.data.running_sum:running_sum_reward"):
    `correct` (0/1: the response's last number is the total; what eval reports as correctness) plus `steps`,
    0.5 x the share of the list's steps written right before the first wrong one ("a3b10c12d16" for 3,7,1,4:
    two of four).  Policies learn to stop before their first error with it (configs/tiny_cpu_reasoning.yaml)."""
    expected = _STEP.findall(running_sum_example(tuple(int(c) for c in question[1::2])).solution)
    right = 0
    for (letter, number), (want_letter, want) in zip(_STEP.findall(response), expected):
        if letter != want_letter or int(number) != int(want):
            break
        right += 1
    found, _how = extract_answer(response, ["last_number"])  # the recipe's verifier: the same correctness
    correct = 1.0 if found is not None and answers_match(found, answer) else 0.0
    return {"correct": correct, "steps": 0.5 * right / len(expected)}


_STEP = re.compile(r"([a-z])(\d+)")
