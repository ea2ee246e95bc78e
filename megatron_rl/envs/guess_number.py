"""`guess_number`: find a hidden integer from "higher" / "lower" feedback within a number of guesses.

    env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=100, max_guesses=7))
    examples = env.make_examples(100, seed=0)      # data Examples; the answer is the hidden number
    env.reset(examples[0]); env.step("50")         # StepResult("higher", None, False)

A guess is the last whole number in the turn.  The right guess earns reward 1.0 and ends the
episode (`done`); the last allowed wrong guess ends it with reward 0.0 (`done`).  A turn with no
number, or a number outside the range, is feedback that does not use up a guess (the episode's
`max_turns` still bounds it).  Binary search finds any of 2^k - 1 numbers in k guesses; `expert` plays it
(the demonstrations of an SFT run, envs/demonstrations.py).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from megatron_rl.envs.example import Example
from megatron_rl.envs.protocol import Environment, StepResult

_INT_RE = re.compile(r"-?\d+")


@dataclasses.dataclass(kw_only=True)
class GuessNumberConfig:
    """The `guess_number` environment's section."""

    low: int = 1
    """Smallest possible hidden number."""
    high: int = 100
    """Largest possible hidden number."""
    max_guesses: int = 7
    """Guesses allowed (in range); the last wrong one ends the episode with reward 0."""

    def __post_init__(self) -> None:
        for name in ("low", "high", "max_guesses"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.high <= self.low:
            raise ValueError(f"high must be > low, got low={self.low}, high={self.high}")
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {self.max_guesses}")


class GuessNumberEnvironment(Environment):
    name = "guess_number"
    observation_role = "user"

    def __init__(self, config: GuessNumberConfig):
        self.config = config
        self._hidden: int | None = None
        self._guesses = 0

    @property
    def system_prompt(self) -> str:
        return "Find the hidden number. Reply with one whole number per turn; you will hear higher or lower."

    def question(self) -> str:
        c = self.config
        return (f"I am thinking of a whole number from {c.low} to {c.high}. You have {c.max_guesses} guesses. "
                f"What is your first guess?")

    def make_examples(self, count: int, *, seed: int, prefix: str = "guess") -> list[Example]:
        """`count` examples with hidden numbers drawn from Random(seed)."""
        rng = random.Random(seed)
        return [Example(id=f"{prefix}-{seed}-{i}", question=self.question(),
                        answer=str(rng.randint(self.config.low, self.config.high))) for i in range(count)]

    def reset(self, example: Any) -> str:
        try:
            hidden = int(example.answer)
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"guess_number needs an example whose answer is a whole number, got {example!r}") from None
        if not self.config.low <= hidden <= self.config.high:
            raise ValueError(f"hidden number {hidden} is outside [{self.config.low}, {self.config.high}]")
        self._hidden, self._guesses = hidden, 0
        self._bounds = [self.config.low, self.config.high]  # what the feedback so far leaves possible
        return example.question

    def expert(self) -> str:
        """Binary search: the middle of what the feedback so far leaves possible."""
        if self._hidden is None:
            raise RuntimeError("expert before reset")
        return str(sum(self._bounds) // 2)

    def step(self, action: str) -> StepResult:
        if self._hidden is None:
            raise RuntimeError("step before reset")
        c = self.config
        numbers = _INT_RE.findall(action)
        if not numbers:
            return StepResult(f"No guess found: reply with one whole number from {c.low} to {c.high}.")
        guess = int(numbers[-1])
        if not c.low <= guess <= c.high:
            return StepResult(f"{guess} is outside the range: guess a whole number from {c.low} to {c.high}.")
        self._guesses += 1
        info = {"guesses": self._guesses}
        if guess == self._hidden:
            return StepResult("Correct!", reward=1.0, done=True, info=info)
        if self._guesses >= c.max_guesses:
            return StepResult(f"Out of guesses: it was {self._hidden}.", reward=0.0, done=True, info=info)
        if guess < self._hidden:
            self._bounds[0] = max(self._bounds[0], guess + 1)
            return StepResult("higher", info=info)
        self._bounds[1] = min(self._bounds[1], guess - 1)
        return StepResult("lower", info=info)
