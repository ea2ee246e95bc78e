"""One reward for training and eval, and eval that counts what it could not grade.

The trajectory's reward (what GRPO learns from) and the eval mean (what a run reports) both
come from the verifier's weighted components, so no setting can make them disagree; a response
the verifier failed on is excluded from the eval means and counted, never silently dropped.
"""

from __future__ import annotations

import time

import pytest

from megatron_rl.reward.math_verifier import RewardConfig, Score, score_response
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.train.roles import eval_summary, to_trajectories

pytestmark = pytest.mark.unit


def _sample(response_tokens: list[int]) -> RolloutSample:
    now = time.time()
    return RolloutSample(prompt_tokens=[1, 2], response_tokens=response_tokens,
                         behavior_logprobs=[-1.0] * len(response_tokens), policy_versions=[0] * len(response_tokens),
                         sampling={"temperature": 1.0}, finish_reason="stop", started_at=now, finished_at=now,
                         extra={"round": 0, "prompt_id": "p", "answer": "5"})


@pytest.mark.parametrize("cfg", [
    RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"], correctness_only=True,
                 correctness_weight=2.0, format_weight=0.5),
    RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"], correctness_weight=2.0,
                 format_weight=0.5, overlong_limit=4, overlong_buffer=2),
])
def test_trajectory_reward_equals_the_reward_eval_reports(cfg):
    texts = ["5", "7", "x", "5 and more"]
    scores = [score_response(t, "5", cfg, length=len(t)) for t in texts]
    trajs = to_trajectories([_sample([3] * len(t)) for t in texts], scores, tokenizer_hash="h", dataset_version="d")
    for traj, score in zip(trajs, scores):
        assert traj.reward == pytest.approx(score.reward)
    eval_reward, _, _ = eval_summary(scores)
    assert eval_reward == pytest.approx(sum(t.reward for t in trajs) / len(trajs))
    if cfg.correctness_only:
        assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]  # the control: correctness alone


def test_eval_counts_verifier_errors_instead_of_dropping_them_silently():
    cfg = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"])
    scores = [score_response("5", "5", cfg), score_response("4", "5", cfg),
              Score.failed("timeout", cfg.grader_version()), Score.failed("crash", cfg.grader_version())]
    reward, correctness, errors = eval_summary(scores)
    assert errors == 2
    assert correctness == pytest.approx(0.5)  # over the two graded responses only, never as zeros
    assert reward == pytest.approx((scores[0].reward + scores[1].reward) / 2)
    nothing = eval_summary([Score.failed("timeout", cfg.grader_version())])
    assert nothing[2] == 1 and nothing[0] != nothing[0]  # NaN: no graded response, no number
