"""One multi-turn episode as ONE token sequence, and its trajectory fields.

    ep = Episode(prompt_tokens, max_total_tokens=2048)
    ep.add_assistant(tokens, logprobs, versions)   # sampled by the policy: mask 1
    ep.add_observation(obs_tokens)                  # from the environment: mask 0, logprob 0
    ep.finish("done", reward=1.0)
    make_trajectory(**trajectory_fields(ep), id=..., prompt_id=..., ...)

Shapes (P = prompt tokens, R = response tokens = everything after the prompt):
    tokens            [P + R]  prompt, then assistant and observation segments in order
    action_mask       [R]      1 on assistant tokens, 0 on observation tokens
    behavior_logprobs [R]      the sampler's logprob on assistant tokens, 0.0 on observations
    policy_versions   [R]      the sampling version on assistant tokens; an observation token
                               carries the version of the assistant token before it (so it never
                               makes the episode look staler than its sampled tokens)

Segments are only appended: earlier tokens are never re-tokenized or changed.  An episode ended
by `env_error` or `timeout` is not scored (status verifier_error / verifier_timeout, no reward,
excluded from the loss, as a verifier failure is); the others are scored with the sum of the
environment's step rewards (0.0 when it gave none).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from megatron_rl.envs.protocol import TERMINAL_REASONS

# terminal reason -> (trajectory status, error code) for episodes that are not scored
_UNSCORED = {"env_error": ("verifier_error", "env_error"), "timeout": ("verifier_timeout", "env_step_timeout")}


class EpisodeError(ValueError):
    """An episode used against its contract (by the caller, not the policy or the environment)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of tokens from one source: `kind` is "assistant" or "observation"; [start, end) in the response."""

    kind: str
    start: int
    end: int


class Episode:
    """Prompt tokens, then assistant and observation segments appended turn by turn."""

    def __init__(self, prompt_tokens: Sequence[int], *, max_total_tokens: int):
        self.prompt_tokens = [int(t) for t in prompt_tokens]
        self.max_total_tokens = int(max_total_tokens)
        self.response_tokens: list[int] = []
        self.action_mask: list[int] = []
        self.behavior_logprobs: list[float] = []
        self.policy_versions: list[int] = []
        self.segments: list[Segment] = []
        self.rewards: list[float] = []
        self.turns = 0
        self.tool_calls = 0  # counted by the runner from StepResult.info, for metrics (metrics.py)
        self.tool_errors = 0
        self.sandbox_violations = 0  # what the policy's code tried and the sandbox refused (python_tool.py)
        self.step_seconds: list[float] = []  # wall time of each environment step
        self.terminal_reason: str | None = None
        self.error = ""
        if len(self.prompt_tokens) >= self.max_total_tokens:
            raise EpisodeError(f"the prompt has {len(self.prompt_tokens)} tokens, max_total_tokens is "
                               f"{self.max_total_tokens}: no room for a response")

    @classmethod
    def failed_at_reset(cls, error: str) -> Episode:
        """An episode whose environment raised in `reset`: no tokens, terminal reason env_error."""
        ep = cls([], max_total_tokens=1)
        ep.finish("env_error", error=error)
        return ep

    @property
    def tokens(self) -> list[int]:
        """The whole sequence the engine sees: prompt + response."""
        return self.prompt_tokens + self.response_tokens

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens fit: the most the next generate call may produce."""
        return self.max_total_tokens - len(self.prompt_tokens) - len(self.response_tokens)

    @property
    def finished(self) -> bool:
        return self.terminal_reason is not None

    @property
    def reward(self) -> float | None:
        """Sum of the step rewards, or None for an unscored episode (env_error, timeout)."""
        if self.terminal_reason in _UNSCORED:
            return None
        return float(sum(self.rewards))

    def add_assistant(self, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | int) -> None:
        """Append one assistant turn as sampled: its tokens, their logprobs and policy versions."""
        self._check_open("add_assistant")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EpisodeError("an assistant turn needs at least one token")
        if len(tokens) > self.remaining_tokens:
            raise EpisodeError(f"assistant turn of {len(tokens)} tokens exceeds the {self.remaining_tokens} "
                               f"left of max_total_tokens={self.max_total_tokens}: cap generation at "
                               f"Episode.remaining_tokens")
        logprobs = [float(x) for x in logprobs]
        versions = [int(versions)] * len(tokens) if np.ndim(versions) == 0 else [int(v) for v in versions]
        for name, values in (("logprobs", logprobs), ("versions", versions)):
            if len(values) != len(tokens):
                raise EpisodeError(f"assistant turn: {len(values)} {name} for {len(tokens)} tokens")
        if not all(math.isfinite(x) and x <= 0.0 for x in logprobs):
            raise EpisodeError("assistant turn: behavior logprobs must be finite and <= 0")
        if min(versions) < 0:
            raise EpisodeError(f"assistant turn: negative policy version {min(versions)}")
        self._append("assistant", tokens, 1, logprobs, versions)
        self.turns += 1

    def add_observation(self, tokens: Sequence[int]) -> None:
        """Append an observation's tokens (tokenized once by the caller): mask 0, logprob 0."""
        self._check_open("add_observation")
        tokens = [int(t) for t in tokens]
        if not self.segments or self.segments[-1].kind != "assistant":
            raise EpisodeError("an observation must follow an assistant turn")
        if not tokens:
            raise EpisodeError("an observation needs at least one token")
        if len(tokens) > self.remaining_tokens:
            raise EpisodeError(f"observation of {len(tokens)} tokens exceeds the {self.remaining_tokens} left")
        last_version = self.policy_versions[-1]
        self._append("observation", tokens, 0, [0.0] * len(tokens), [last_version] * len(tokens))

    def add_reward(self, reward: float | None) -> None:
        if reward is not None:
            self.rewards.append(float(reward))

    def finish(self, reason: str, *, error: str = "") -> None:
        """End the episode with one of TERMINAL_REASONS (`error` says what failed, for env_error/timeout)."""
        self._check_open("finish")
        if reason not in TERMINAL_REASONS:
            raise EpisodeError(f"terminal reason {reason!r} is not one of {list(TERMINAL_REASONS)}")
        if reason in _UNSCORED and not error:
            raise EpisodeError(f"terminal reason {reason!r} needs an error message")
        self.terminal_reason = reason
        self.error = error

    def _check_open(self, what: str) -> None:
        if self.terminal_reason is not None:
            raise EpisodeError(f"{what} on an episode already finished ({self.terminal_reason})")

    def _append(self, kind: str, tokens: list[int], mask: int, logprobs: list[float], versions: list[int]) -> None:
        start = len(self.response_tokens)
        self.response_tokens.extend(tokens)
        self.action_mask.extend([mask] * len(tokens))
        self.behavior_logprobs.extend(logprobs)
        self.policy_versions.extend(versions)
        self.segments.append(Segment(kind, start, len(self.response_tokens)))


def trajectory_fields(episode: Episode) -> dict:
    """The keyword arguments of trajectory.make_trajectory that the episode determines.

    The caller adds the rest (id, prompt_id, dataset_version, tokenizer_hash, sampling_config,
    grader_version, rollout_started_at, scored_at, source).  Raises EpisodeError for an unfinished
    episode or one without an assistant token (e.g. env_error at reset): count it, do not enqueue it.
    """
    if not episode.finished:
        raise EpisodeError("trajectory_fields of an unfinished episode: call finish() first")
    if not any(episode.action_mask):
        raise EpisodeError(f"episode ended ({episode.terminal_reason}: {episode.error or 'no error'}) before "
                           f"any assistant token: nothing to train on; count it, do not enqueue it")
    fields = dict(
        prompt_tokens=np.asarray(episode.prompt_tokens, np.int32),
        response_tokens=np.asarray(episode.response_tokens, np.int32),
        action_mask=np.asarray(episode.action_mask, np.uint8),
        behavior_logprobs=np.asarray(episode.behavior_logprobs, np.float32),
        policy_versions=np.asarray(episode.policy_versions, np.int32),
        terminal_reason=episode.terminal_reason,
    )
    if episode.terminal_reason in _UNSCORED:
        status, code = _UNSCORED[episode.terminal_reason]
        fields.update(status=status, error_code=f"{code}: {episode.error}"[:500], reward_components={})
    else:
        fields.update(status="ok", reward_components={"env": episode.reward})
    return fields
