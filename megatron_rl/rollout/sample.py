"""RolloutSample: one generated response, token ids only, with what the learner needs.

    info = [PromptInfo(id=ex.id, round=r, answer=ex.reference, fields=ex.reward_fields()) for ex in examples]
    samples = fleet.generate(prompts, n=4, sampling={"seed": 3}, info=info)   # each carries its prompt's info
    sample.prompt.id, sample.weights, sample.segments, sample.episode, sample.score   # typed, nothing else rides

Legend: P = prompt length, R = response length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl.reward.math_verifier import Score

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(kw_only=True)
class PromptInfo:
    """What the caller knows of a prompt: handed to the fleet beside it, carried by each of its samples."""

    id: str = ""
    """The data example's id (envs/example.py Example.id); trajectory ids are '<round>/<id>/<i>'."""
    round: int | None = None
    """The rollout round (a streaming run: the prompt group's serial) it was drawn for; None outside training."""
    answer: str = ""
    """The reference answer the verifier grades the response against."""
    fields: dict[str, Any] = field(default_factory=dict)
    """What a reward function is given beside the texts (Example.reward_fields())."""
    max_tokens: int | None = None
    """The example's own response budget, capping the sampling's max_tokens (rollout/requests.py); None: none."""


@dataclass(frozen=True)
class EpisodeSummary:
    """What the scorer and the metrics need of a finished multi-turn episode (rollout/episodes.py)."""

    env: str
    terminal_reason: str
    reward: float | None
    error: str
    turns: int
    tool_calls: int
    tool_errors: int
    step_seconds: list[float]
    sandbox_violations: int = 0

    @classmethod
    def of(cls, env: str, ep) -> "EpisodeSummary":
        """The summary of a finished envs/episode.py Episode of environment `env`."""
        return cls(env, ep.terminal_reason, ep.reward, ep.error, ep.turns, ep.tool_calls, ep.tool_errors,
                   list(ep.step_seconds), ep.sandbox_violations)

    @property
    def finished(self) -> bool:
        """Always: a summary is made at the episode's end (what envs/metrics.py episode_metrics asks)."""
        return True


@dataclass(kw_only=True)
class RolloutSample:
    prompt_tokens: list[int]
    """Prompt token ids [P]."""
    response_tokens: list[int]
    """Generated token ids [R] (the EOS/stop token included when generation stopped on it)."""
    behavior_logprobs: list[float]
    """Log-probability of each response token under the policy that sampled it [R]."""
    policy_versions: list[int]
    """Policy version that produced each response token [R]."""
    sampling: dict[str, Any]
    """The sampling parameters used (temperature, top_p, top_k, max_tokens, seed, ...)."""
    finish_reason: str
    """"stop" (EOS or stop token), "length" (max_tokens or max_model_len) or "abort"."""
    started_at: float
    """Wall-clock time (time.time()) the generate call containing this sample started."""
    finished_at: float
    """Wall-clock time it returned."""
    prompt: PromptInfo = field(default_factory=PromptInfo)
    """The caller's PromptInfo of the prompt (its id, round, reference answer, reward fields)."""
    weights: dict[str, str] = field(default_factory=dict)
    """{version: weights digest} of every version that sampled a response token (rollout/provenance.py)."""
    segments: list[list[int]] = field(default_factory=list)
    """[start, end, version, kv_version] spans tiling the response (a streaming engine's; [] otherwise):
    kv_version is the oldest weights whose KV the span's tokens attended to (rollout/stream_engine.py)."""
    episode: EpisodeSummary | None = None
    """A multi-turn episode's summary (rollout/episodes.py); None: a single-turn sample."""
    score: Score | None = None
    """The producer's grade (dynamic sampling, a streaming producer), so it is not graded again; None: ungraded."""
    action_mask: list[int] | None = None
    """1 on tokens the policy sampled, 0 on tokens it did not (a multi-turn episode's observations) [R];
    None: every response token was sampled."""

    @property
    def generated_tokens(self) -> int:
        """Tokens the policy sampled: the response less a multi-turn episode's observations."""
        return len(self.response_tokens) if self.action_mask is None else int(sum(self.action_mask))

    @property
    def seconds(self) -> float:
        return self.finished_at - self.started_at

    def check(self) -> None:
        """Raise ValueError naming the first inconsistency (lengths, logprobs, reason)."""
        n = len(self.response_tokens)
        if len(self.behavior_logprobs) != n:
            raise ValueError(f"behavior_logprobs has {len(self.behavior_logprobs)} entries for {n} response tokens")
        if len(self.policy_versions) != n:
            raise ValueError(f"policy_versions has {len(self.policy_versions)} entries for {n} response tokens")
        if self.action_mask is not None and (len(self.action_mask) != n or set(self.action_mask) - {0, 1}):
            raise ValueError(f"action_mask must hold {n} entries of 0 or 1")
        bad = next((i for i, lp in enumerate(self.behavior_logprobs) if not (math.isfinite(lp) and lp <= 0)), None)
        if bad is not None:
            raise ValueError(f"behavior_logprobs[{bad}] = {self.behavior_logprobs[bad]} is not a finite log-probability")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {list(FINISH_REASONS)}")
        if self.finished_at < self.started_at:
            raise ValueError("finished_at is before started_at")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutSample":
        """The sample to_dict() gave (a checkpoint's pending rounds); a checkpoint written before the typed
        fields, with their values in an `extra` dict, loads too."""
        from megatron_rl.reward.math_verifier import Score

        data = dict(data)
        old = data.pop("extra", None) or {}
        if old:
            data["prompt"] = {k: old[k] for k in ("round", "answer", "fields", "max_tokens") if k in old}
            data["prompt"]["id"] = old.get("prompt_id", "")
            data.update({k: old[k] for k in ("weights", "segments", "episode", "score") if k in old})
        data["prompt"] = PromptInfo(**(data.get("prompt") or {}))
        data["episode"] = EpisodeSummary(**data["episode"]) if data.get("episode") else None
        data["score"] = Score(**data["score"]) if data.get("score") else None
        return cls(**data)


def reset_failure(group: list[RolloutSample]) -> str | None:
    """The error of a group in which an environment failed at reset (an episode returned with no tokens: nothing
    to train on, rollout/episodes.py), or None; a single-turn group always has tokens."""
    return next((s.episode.error for s in group if not s.response_tokens), None)
