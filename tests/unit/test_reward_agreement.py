"""One reward for training and eval; eval statistics that count what they could not grade.

The trajectory's reward (what GRPO learns from) and the eval mean (what a run reports) both
come from the verifier's weighted components, so no setting can make them disagree; a response
the verifier failed on is excluded from the eval means and counted, never silently dropped.
pass@k is checked against its closed form.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest

from megatron_rl.envs.example import Example
from megatron_rl.evaluation import Decoding, EvalResult, example_outcome, pass_at_k
from megatron_rl.reward.math_verifier import RewardConfig, Score, score_response
from megatron_rl.rollout.sample import PromptInfo, RolloutSample
from megatron_rl.sampling.scoring import to_trajectories

pytestmark = pytest.mark.unit


def _sample(response_tokens: list[int]) -> RolloutSample:
    now = time.time()
    return RolloutSample(prompt_tokens=[1, 2], response_tokens=response_tokens,
                         behavior_logprobs=[-1.0] * len(response_tokens), policy_versions=[0] * len(response_tokens),
                         sampling={"temperature": 1.0}, finish_reason="stop", started_at=now, finished_at=now,
                         prompt=PromptInfo(id="p", round=0, answer="5"))


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
    result = EvalResult("test", Decoding(), [example_outcome(Example(id=str(i), question="q", answer="5"), [t], [sc])
                                             for i, (t, sc) in enumerate(zip(texts, scores))])
    assert result.summary()["reward"] == pytest.approx(sum(t.reward for t in trajs) / len(trajs))
    if cfg.correctness_only:
        assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]  # the control: correctness alone


def test_eval_counts_verifier_errors_instead_of_dropping_them_silently():
    cfg = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"])
    ex = Example(id="a", question="q", answer="5")
    scores = [score_response("5", "5", cfg), score_response("4", "5", cfg),
              Score.failed("timeout", cfg.grader_version()), Score.failed("crash", cfg.grader_version())]
    result = EvalResult("test", Decoding(samples=4, temperature=1.0), [example_outcome(ex, ["5", "4", "?", "?"], scores)])
    s = result.summary(ks=(1, 2))
    assert s["verifier_errors"] == 2
    assert s["correctness"] == pytest.approx(0.5)  # over the two graded responses only, never as zeros
    assert s["reward"] == pytest.approx((scores[0].reward + scores[1].reward) / 2)
    assert s["pass@1"] == pytest.approx(0.5) and s["pass@2"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        result.summary(ks=(8,))
    nothing = EvalResult("test", Decoding(), [example_outcome(ex, ["?"], [Score.failed("timeout", "g")])]).summary()
    assert nothing["verifier_errors"] == 1 and math.isnan(nothing["correctness"])


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 2), (6, 3, 3), (4, 0, 2), (4, 4, 1), (7, 1, 7)])
def test_pass_at_k_is_the_probability_a_random_k_subset_holds_a_correct_sample(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_decoding_refuses_greedy_with_several_samples():
    with pytest.raises(ValueError, match="needs temperature > 0"):
        Decoding(samples=4)
