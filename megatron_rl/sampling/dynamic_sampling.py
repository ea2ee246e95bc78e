"""Dynamic sampling: keep only GRPO groups whose rewards vary, until a round is full.

    ds = DynamicSamplingConfig(enabled=True, oversample=2.0, max_attempts=4)
    kept, stats = select_groups(groups, need=8, taken=set())     # groups: [(prompt_id, samples, scores)]

Why.  A group whose G samples all earn the same reward has zero advantage for every member
(GRPO normalises rewards within the group, eq. (3) of Shao et al. 2024), so it costs a full
rollout and a learner pass and teaches nothing.  Once a policy answers a prompt
deterministically, right or wrong, most groups are like this and learning stalls while the
step still "runs".  DAPO (Yu et al. 2025, sec. 3.2) oversamples prompts and drops those
groups until the batch is full; this module is that rule, bounded:

  attempt a = 0, 1, ..., max_attempts-1: draw ceil(missing x oversample) new prompts, sample
  and grade their groups, keep the informative ones (reward std > min_reward_std among the
  graded members, at least two graded) until `prompts_per_step` groups are kept.

If the attempts run out, the round is filled with the uninformative groups of the last
attempt (a short batch is never trained on) and `filled_groups` says how many.  Every
discarded group's tokens stay counted as generated, so ESR (reporting/telemetry.py) falls by exactly
what the filter threw away, and `system/dynamic_kept_fraction` shows the share of sampled groups kept.
Streaming runs filter group by group as each finishes (sampling/stream_producer.py), within the same bound.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from megatron_rl.config import ConfigError


@dataclass(kw_only=True)
class DynamicSamplingConfig:
    enabled: bool = False
    """Keep only groups whose rewards vary (DAPO's dynamic sampling); off: every sampled group is trained on."""
    oversample: float = 2.0
    """Prompts drawn per missing group in each attempt (>= 1)."""
    max_attempts: int = 4
    """Sampling attempts per round before the round is filled with uninformative groups."""
    min_reward_std: float = 0.0
    """A group is informative when the population std of its graded rewards exceeds this."""

    def __post_init__(self) -> None:
        if not self.oversample >= 1.0:
            raise ConfigError(f"dynamic_sampling.oversample must be >= 1, got {self.oversample}")
        if self.max_attempts < 1:
            raise ConfigError(f"dynamic_sampling.max_attempts must be >= 1, got {self.max_attempts}")
        if self.min_reward_std < 0:
            raise ConfigError(f"dynamic_sampling.min_reward_std must be >= 0, got {self.min_reward_std}")

    def prompts_to_draw(self, missing: int) -> int:
        return max(missing, math.ceil(missing * self.oversample))

    def discard_budget(self, groups: int) -> int:
        """Streaming: uninformative groups a batch of `groups` may throw away before it keeps them, so that a
        batch samples at most max_attempts x oversample x `groups` groups, as rounds do."""
        return math.ceil(groups * (self.max_attempts * self.oversample - 1))


def is_informative(scores: list, min_reward_std: float = 0.0) -> bool:
    """True when the graded rewards of one group vary (verifier errors are excluded, as in the loss)."""
    rewards = [s.reward for s in scores if s.ok]
    return len(rewards) >= 2 and statistics.pstdev(rewards) > min_reward_std


@dataclass
class Group:
    prompt_id: str
    samples: list
    scores: list

    @property
    def tokens(self) -> int:
        return sum(s.generated_tokens for s in self.samples)  # a multi-turn episode's observations were not generated


def select_groups(groups: list[Group], *, need: int, taken: set[str], min_reward_std: float = 0.0
                  ) -> tuple[list[Group], list[Group]]:
    """Split one attempt's groups into (kept, discarded): at most `need` informative groups whose
    prompt is not already in `taken` (a prompt appears once per round: its group is its id)."""
    kept, discarded = [], []
    for g in groups:
        if len(kept) < need and g.prompt_id not in taken and is_informative(g.scores, min_reward_std):
            kept.append(g)
            taken.add(g.prompt_id)
        else:
            discarded.append(g)
    return kept, discarded


def fill(kept: list[Group], leftovers: list[Group], *, need: int, taken: set[str]) -> list[Group]:
    """Uninformative groups (newest first) that complete a round the attempts could not fill."""
    filler = []
    for g in reversed(leftovers):
        if len(kept) + len(filler) >= need:
            break
        if g.prompt_id not in taken:
            filler.append(g)
            taken.add(g.prompt_id)
    if len(kept) + len(filler) < need:
        raise RuntimeError(f"dynamic sampling could not fill a round: {len(kept) + len(filler)} of {need} "
                           f"distinct prompts were sampled (raise dynamic_sampling.max_attempts or oversample)")
    return filler
