"""RolloutSample: one generated response, token ids only, with what the learner needs.

Legend: P = prompt length, R = response length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")


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
    extra: dict[str, Any] = field(default_factory=dict)
    """Caller's passthrough (e.g. prompt id, group index)."""
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
