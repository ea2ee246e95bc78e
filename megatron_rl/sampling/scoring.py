"""Grading rollout samples into trajectories: the verifier pool and the trajectory contract.

    scorer = Scorer.create(cfg.reward, tokenizer, tokenizer_hash=h, dataset_version=v)   # its verifier pool
    scores = scorer.grade(samples)            # verifier Scores (decoded response vs the prompt's answer)
    trajs, seconds = scorer.score(samples)    # contract-complete Trajectories, ready to enqueue

Samples graded already (by dynamic sampling or a streaming producer: `sample.score`) are not graded twice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megatron_rl.reward.math_verifier import RewardConfig
from megatron_rl.reward.pool import VerifierPool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Scorer:
    """Owns the verifier pool; turns samples into trajectories stamped with the run's identity."""

    def __init__(self, verifier: VerifierPool, tokenizer: PreTrainedTokenizerBase, *, tokenizer_hash: str,
                 dataset_version: str):
        self.verifier = verifier
        self.tokenizer = tokenizer
        self.tokenizer_hash = tokenizer_hash
        self.dataset_version = dataset_version

    @classmethod
    def create(cls, reward: RewardConfig, tokenizer: PreTrainedTokenizerBase, *, tokenizer_hash: str,
               dataset_version: str) -> "Scorer":
        """A scorer with its own verifier pool of the `reward:` section's workers."""
        return cls(VerifierPool(reward), tokenizer, tokenizer_hash=tokenizer_hash, dataset_version=dataset_version)

    def grade(self, samples: list) -> list:
        """The verifier pool's Score of every sample (decoded response vs the prompt's answer); a multi-turn
        episode's Score is its environment's reward (episode_score)."""
        if samples and all(s.episode is not None for s in samples):
            from megatron_rl.rollout.episodes import episode_score

            return [episode_score(s.episode) for s in samples]
        texts = [self.tokenizer.decode(s.response_tokens, skip_special_tokens=True) for s in samples]
        answers, lengths = [s.prompt.answer for s in samples], [len(s.response_tokens) for s in samples]
        contexts = None
        if self.verifier.cfg.function:  # a reward function also sees the prompt and the example's fields
            contexts = [{"prompt": self.tokenizer.decode(s.prompt_tokens, skip_special_tokens=True),
                         **s.prompt.fields} for s in samples]
        return self.verifier.score(texts, answers, lengths, contexts)

    def score(self, samples: list) -> tuple[list, float]:
        """Grade every sample (unless graded already); build contract-complete trajectories."""
        t0 = time.perf_counter()
        if samples and all(s.score is not None for s in samples):  # graded by the producer already
            scores = [s.score for s in samples]
        else:
            scores = self.grade(samples)
        trajs = to_trajectories(samples, scores, tokenizer_hash=self.tokenizer_hash,
                                dataset_version=self.dataset_version)
        return trajs, time.perf_counter() - t0

    def counters(self) -> dict:
        """The verifier pool's error counters (timeouts, crashes) so far."""
        return self.verifier.counters()

    def close(self) -> None:
        self.verifier.close()


def to_trajectories(samples: list, scores: list, *, tokenizer_hash: str, dataset_version: str) -> list:
    """Rollout samples + verifier scores -> Trajectories (ids '<round>/<prompt_id>/<i>').

    A sample whose grading failed (timeout, crash) keeps no reward at all: status
    'verifier_error' with the error code, so it is excluded from the loss and counted.
    """
    from megatron_rl.trajectory import make_trajectory

    scored_at = time.time()
    trajs = []
    index: dict[str, int] = {}
    for s, sc in zip(samples, scores, strict=True):
        key = f"r{s.prompt.round:06d}/{s.prompt.id}"
        i = index[key] = index.get(key, -1) + 1
        # The verifier's weighted components: they sum to the reward eval reports too.
        components = dict(sc.components) if sc.ok else {}
        trajs.append(make_trajectory(
            id=f"{key}/{i}", prompt_id=s.prompt.id, dataset_version=dataset_version,
            policy_versions=s.policy_versions, tokenizer_hash=tokenizer_hash, prompt_tokens=s.prompt_tokens,
            response_tokens=s.response_tokens, behavior_logprobs=s.behavior_logprobs, sampling_config=s.sampling,
            reward_components=components, grader_version=sc.grader_version, action_mask=s.action_mask,
            terminal_reason=s.finish_reason if s.episode is None else s.episode.terminal_reason,
            rollout_started_at=s.started_at, scored_at=scored_at,
            status="ok" if sc.ok else ("verifier_timeout" if sc.error == "timeout" else "verifier_error"),
            error_code=sc.error or "", weights=dict(s.weights), segments=[list(g) for g in s.segments],
        ))
    return trajs