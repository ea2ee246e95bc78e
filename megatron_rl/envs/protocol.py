"""The environment protocol of multi-turn episodes (issue 28): what an environment is and returns.

    class Mine(Environment):
        name = "mine"
        def reset(self, example) -> str: ...            # the first observation (the user's message)
        def step(self, action: str) -> StepResult: ...   # one assistant turn's text -> what comes back

An environment speaks text; the episode (episode.py) holds the tokens.  The runner (runner.py)
decodes the policy's tokens once, calls `step`, and appends the observation's tokens, so earlier
turns are never re-tokenized.  `step` returns the observation, an optional reward, and `done`.
Raising from `reset`/`step` ends the episode with terminal reason `env_error` (excluded from the
loss); a step slower than `EpisodeLimits.step_timeout_s` ends it with `timeout`.  The policy's
own mistakes (a malformed tool call, code that crashes) are observations, not errors.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Mapping

TERMINAL_REASONS = ("done", "max_turns", "max_tokens", "env_error", "timeout")
"""Why an episode ended: the environment said done; the turn or token limit; the environment
raised; an environment step ran past the per-step timeout."""

OBSERVATION_ROLES = ("tool", "user")


class EnvError(RuntimeError):
    """The environment itself failed (not the policy): the episode ends with `env_error`."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one environment step returns."""

    observation: str
    """Text shown to the policy before its next turn (tokenized once, mask 0)."""
    reward: float | None = None
    """Reward earned by this step, or None; an episode's reward is the sum of its steps'."""
    done: bool = False
    """The episode is over (the observation of a final step is not appended)."""
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Counters for metrics, e.g. {"tool_calls": 1, "tool_errors": 0}."""

    def __post_init__(self) -> None:
        if not isinstance(self.observation, str):
            raise EnvError(f"StepResult.observation must be a str, got {type(self.observation).__name__}")
        if self.reward is not None and (isinstance(self.reward, bool) or not isinstance(self.reward, (int, float))
                                        or not math.isfinite(self.reward)):
            raise EnvError(f"StepResult.reward must be a finite number or None, got {self.reward!r}")
        if not isinstance(self.done, bool):
            raise EnvError(f"StepResult.done must be a bool, got {type(self.done).__name__}")


class Environment(abc.ABC):
    """A text environment.  One instance runs one episode at a time; `reset` starts a new one."""

    name: ClassVar[str] = ""
    observation_role: ClassVar[str] = "tool"
    """Chat role of the observations: "tool" (tool results) or "user" (feedback)."""

    @property
    def system_prompt(self) -> str | None:
        """The system message of the prompt, or None."""
        return None

    @property
    def tools(self) -> list[dict] | None:
        """Tool schemas (JSON-schema function specs) for the chat template's `tools=`, or None."""
        return None

    @abc.abstractmethod
    def reset(self, example: Any) -> str:
        """Start an episode for `example` (envs/example.py Example); return the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """React to one assistant turn (its decoded text)."""

    def expert(self) -> str:
        """The next assistant turn's text an expert would send, given the episode so far (this environment's
        state): what supervised fine-tuning on this environment imitates (envs/demonstrations.py)."""
        raise NotImplementedError(f"environment {self.name!r} has no expert: SFT on its episodes needs one "
                                  "(Environment.expert)")

    def close(self) -> None:
        """Release what the environment holds (subprocesses, files).  Idempotent."""


@dataclasses.dataclass(kw_only=True)
class EpisodeLimits:
    """Limits of one episode (the `data.env_limits` section when wired)."""

    max_turns: int = 8
    """Assistant turns at most; the episode ends with `max_turns` after the last one."""
    max_total_tokens: int = 2048
    """Prompt + response tokens at most; an observation that would leave no room ends it with `max_tokens`."""
    step_timeout_s: float = 30.0
    """Wall-clock seconds one environment step may take; past it the episode ends with `timeout`."""

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {self.max_turns!r}")
        if (isinstance(self.max_total_tokens, bool) or not isinstance(self.max_total_tokens, int)
                or self.max_total_tokens < 2):
            raise ValueError(f"max_total_tokens must be an int >= 2, got {self.max_total_tokens!r}")
        if not isinstance(self.step_timeout_s, (int, float)) or not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be a number > 0, got {self.step_timeout_s!r}")
