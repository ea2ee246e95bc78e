"""Trajectories -> learner batch, and what a verifier timeout does to a training step.

A verifier timeout is not a zero reward: the sample is error-coded, gets no reward, is left
out of its group's advantage statistics and out of the loss, and is counted in the metrics.
The timeout is real (a grader test double that hangs, killed by the pool's per-call timeout).
"""

from __future__ import annotations

import math
import time

import pytest

from megatron_rl.grpo.loss import GRPOLossConfig
from megatron_rl.grpo.step_metrics import grpo_metrics
from megatron_rl.reward.math_verifier import RewardConfig, score_response
from megatron_rl.reward.pool import VerifierPool
from megatron_rl.rollout.sample import PromptInfo, RolloutSample
from megatron_rl.train.batch import build_batch
from megatron_rl.sampling.scoring import to_trajectories
from megatron_rl.reporting.telemetry import Telemetry

pytestmark = pytest.mark.unit

REWARD = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"], format_weight=0.5,
                      timeout_s=1.0, num_workers=1)


def hanging_grader(response, reference, cfg, length):
    """Test double: the response 'HANG' never finishes grading; others grade normally."""
    if response == "HANG":
        time.sleep(600)
    return score_response(response, reference, cfg, length)


def sample(prompt, response, prompt_id, logp=-1.0):
    now = time.time()
    return RolloutSample(prompt_tokens=prompt, response_tokens=response, behavior_logprobs=[logp] * len(response),
                         policy_versions=[3] * len(response), sampling={"temperature": 1.0}, finish_reason="stop",
                         started_at=now, finished_at=now, prompt=PromptInfo(id=prompt_id, round=7, answer="5"))


def test_layout_of_tokens_masks_and_logprobs():
    samples = [sample([1, 2, 3], [4, 5], "p", -0.5), sample([1, 2], [6, 7, 8], "p", -0.25)]
    scores = [score_response(t, "5", REWARD) for t in ("5", "x")]
    trajs = to_trajectories(samples, scores, tokenizer_hash="h", dataset_version="d")
    assert [t.id for t in trajs] == ["r000007/p/0", "r000007/p/1"]
    batch, stats = build_batch(trajs, pad_id=0, loss_cfg=GRPOLossConfig(), micro_batch_size=1)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]]
    # Prediction grid [B, T-1]: response token k of a P-token prompt sits at P + k - 1.
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch["behavior_logprobs"].tolist() == [[0, 0, -0.5, -0.5], [0, -0.25, -0.25, -0.25]]
    # Rewards 1.5 and 0: group mean 0.75, sample std sqrt(1.125) -> +-0.7071.
    assert batch["advantages"].tolist() == pytest.approx([0.75 / math.sqrt(1.125), -0.75 / math.sqrt(1.125)])
    assert stats["tokens_in_loss"] == 5 and stats["informative_tokens"] == 5
    assert batch["token_denominator"] == pytest.approx(5 / 2)  # two micro-batches of one
    assert batch["sequence_denominator"] == pytest.approx(2 / 2)


def test_verifier_timeout_is_excluded_and_counted():
    samples = [sample([1, 2], [9], "a"), sample([1, 2], [9], "a"), sample([1, 2], [9], "a"),
               sample([1, 3], [9], "b"), sample([1, 3], [9], "b")]
    texts = ["5", "HANG", "1", "5", "5"]
    with VerifierPool(REWARD, grader=hanging_grader) as pool:
        scores = pool.score(texts, ["5"] * 5, [1] * 5)
        counters = pool.counters()
    assert scores[1].error == "timeout" and scores[1].reward is None
    assert counters["timeout"] == 1
    trajs = to_trajectories(samples, scores, tokenizer_hash="h", dataset_version="d")
    assert trajs[1].status == "verifier_timeout" and trajs[1].error_code == "timeout"
    assert trajs[1].reward is None and trajs[1].reward_components == {}
    batch, stats = build_batch(trajs, pad_id=0, loss_cfg=GRPOLossConfig(), micro_batch_size=1)
    assert batch["loss_mask"][1].sum() == 0  # excluded from the loss
    # Global normalisers over K = 5 micro-batches of one: 4 tokens and 4 sequences in the loss.
    assert batch["token_denominator"] == pytest.approx(4 / 5)
    assert batch["sequence_denominator"] == pytest.approx(4 / 5)
    assert stats["sequences_in_loss"] == 4
    # Group "a" is {1.5, 0.5}: the timed-out sample is not a zero pulling the mean down.
    adv = batch["advantages"].tolist()
    assert adv[1] == 0 and adv[0] == pytest.approx(-adv[2]) and adv[0] > 0
    assert adv[0] == pytest.approx(0.5 / math.sqrt(0.5))
    assert stats["invalid_samples"] == 1 and stats["zero_variance_groups"] == 1  # group "b": 1.5, 1.5
    metrics = Telemetry().step_metrics(
        samples, trajs, trajs, {"loss": 0.1, "grad_norm": 1.0, **{f"adv/{k}": v for k, v in stats.items()}},
        {"rollout": 1.0, "score": 1.0, "learn": 1.0}, {"queue/depth": 0.0}, counters)
    assert metrics["latency/verifier_timeout"] == 1
    assert metrics["latency/verifier_error_rate"] == pytest.approx(1 / 5)  # this step's ungraded share (stop rule)
    assert metrics["learn/invalid_samples"] == 1
    assert metrics["learn/reward_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 1.5) / 4)  # over graded samples only


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError, match="zero trajectories"):
        build_batch([], pad_id=0, loss_cfg=GRPOLossConfig(), micro_batch_size=1)


def test_learner_metrics_reach_the_learn_panel():
    samples = [sample([1, 2], [9], "a"), sample([1, 2], [9], "a")]
    trajs = to_trajectories(samples, [score_response(t, "5", REWARD) for t in ("5", "1")],
                            tokenizer_hash="h", dataset_version="d")
    learn = {"loss": 0.1, "grad_norm": 1.0, "d_lag": 0.25, "d_lag/p50": 0.2, "d_lag/p95": 0.4, "d_lag/p99": 0.45,
             "kl_ref_k2_grad_theta_ref": 0.01, "lag_weight": 0.0, "lag_quarantined": 1.0, "update_successful": 0.0,
             "entropy_coef": 0.06}
    metrics = Telemetry().step_metrics(samples, trajs, trajs, learn, {"rollout": 1.0, "score": 1.0, "learn": 1.0},
                                       {}, {})
    assert metrics["learn/d_lag"] == 0.25 and metrics["learn/d_lag/p50"] == 0.2
    assert metrics["learn/d_lag/p95"] == 0.4 and metrics["learn/d_lag/p99"] == 0.45
    assert metrics["learn/kl_ref_k2_grad_theta_ref"] == 0.01
    assert metrics["learn/entropy_coef"] == 0.06  # the entropy bonus's β_H this step (it may decay)
    assert metrics["numerics/lag_quarantined"] == 1.0 and metrics["numerics/update_successful"] == 0.0
    assert not any(k.startswith("queue/d_lag") for k in metrics)



def test_a_sequence_that_spans_versions_shows_in_the_per_token_lag():
    """Streaming: one sequence's tokens from versions 3 and 5, learned at 5: Δv 2 by its oldest token
    (queue/taken_dv), 2 or 0 per token (queue/taken_token_dv); quarantined trajectories are counted."""
    samples = [sample([1, 2], [9], "a"), sample([1, 2], [9], "a")]
    trajs = to_trajectories(samples, [score_response(t, "5", REWARD) for t in ("5", "1")],
                            tokenizer_hash="h", dataset_version="d")
    learn = {"loss": 0.1, "grad_norm": 1.0, "dv": [2, 0], "token_dv": [2, 2, 0, 0, 0, 0, 0, 0],
             "quarantined_trajectories": 1.0}
    metrics = Telemetry().step_metrics(samples, trajs, trajs, learn, {"rollout": 1.0, "score": 1.0, "learn": 1.0},
                                       {}, {})
    assert metrics["queue/taken_dv/p50"] == 1.0 and metrics["queue/taken_token_dv/p50"] == 0.0
    assert metrics["queue/taken_token_dv/p99"] == pytest.approx(2.0)
    assert metrics["learn/quarantined_trajectories"] == 1.0


def test_missing_metrics_are_absent_not_zero():
    """A metric the step did not measure is absent (so `d_lag p99 < 1e-4` cannot pass on a missing
    lag): telemetry and the loss metrics never fill in 0."""
    samples = [sample([1, 2], [9], "a"), sample([1, 2], [9], "a")]
    trajs = to_trajectories(samples, [score_response(t, "5", REWARD) for t in ("5", "1")],
                            tokenizer_hash="h", dataset_version="d")
    metrics = Telemetry().step_metrics(samples, trajs, [], {"loss": 0.1, "grad_norm": 1.0},
                                       {"rollout": 1.0, "score": 1.0, "learn": 1.0}, {}, {})
    for prefix in ("learn/d_lag", "queue/taken_dv", "learn/zero_variance_groups", "learn/invalid_samples",
                   "system/esr", "system/effective_tokens_per_s", "numerics/lag_quarantined"):
        assert not any(k.startswith(prefix) for k in metrics), (prefix, sorted(metrics))
    nothing = {"tokens": 0.0, "sequences": 0.0, "pg_sum": 0.0, "clip_sum": 0.0, "ratio_sum": 0.0, "adv_sum": 0.0,
               "rows": 2.0, "seq_tokens": [0.0, 0.0], "seq_lag_sum": [0.0, 0.0], "seq_ratio_max": [1.0, 1.0]}
    loss_metrics = grpo_metrics(nothing, GRPOLossConfig())  # every row masked out: no token in the loss
    assert not any(k.startswith("d_lag") for k in loss_metrics), sorted(loss_metrics)
