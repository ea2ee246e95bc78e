"""Step metrics of multi-turn episodes count what the policy sampled, not the observations in between
(reporting/telemetry.py), and an experiment's generated tokens are the steps' own count (experiment/report.py).

    python -m pytest tests/unit/test_episode_metrics.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.experiment.report import run_costs
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.reporting.telemetry import Telemetry

pytestmark = pytest.mark.unit

PHASES = {"rollout": 1.0, "score": 0.1, "learn": 1.0}


def _episode(sampled: int, observed: int) -> RolloutSample:
    """`sampled` policy tokens (logprob -1), then `observed` observation tokens (logprob 0, mask 0), then one more
    sampled token (logprob -3)."""
    mask = [1] * sampled + [0] * observed + [1]
    lps = [-1.0] * sampled + [0.0] * observed + [-3.0]
    return RolloutSample(prompt_tokens=[1], response_tokens=[5] * len(mask), behavior_logprobs=lps,
                         policy_versions=[0] * len(mask), sampling={}, finish_reason="stop", started_at=0.0,
                         finished_at=1.0, action_mask=mask)


def test_response_length_and_entropy_count_only_sampled_tokens():
    samples = [_episode(3, 10), _episode(5, 30)]  # 4 and 6 sampled tokens, 40 observation tokens
    out = Telemetry().step_metrics(samples, [], [], {}, PHASES, {}, {})
    assert out["learn/response_length"] == pytest.approx(5.0)  # not (14 + 36) / 2
    assert out["system/generated_tokens"] == pytest.approx(10.0)
    assert out["learn/entropy_estimate"] == pytest.approx((8 * 1.0 + 2 * 3.0) / 10)  # observations' 0.0 left out
    assert out["numerics/min_behavior_logprob"] == pytest.approx(-3.0)


def test_single_turn_samples_count_every_response_token():
    plain = _episode(3, 0)
    plain.action_mask = None
    out = Telemetry().step_metrics([plain], [], [], {}, PHASES, {}, {})
    assert out["learn/response_length"] == pytest.approx(4.0)
    assert out["learn/entropy_estimate"] == pytest.approx(np.mean([1.0, 1.0, 1.0, 3.0]))


def _run_dir(tmp_path, rows):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"run": {"prompts_per_step": 2, "group_size": 4}}))
    (tmp_path / "result.json").write_text(json.dumps({"wall_s": 10.0}))
    return tmp_path


def test_experiment_costs_take_the_steps_generated_tokens(tmp_path):
    run = _run_dir(tmp_path, [{"step": 1, "learn/response_length": 5.0, "system/generated_tokens": 70.0},
                              {"step": 2, "learn/response_length": 5.0, "system/generated_tokens": 30.0}])
    assert run_costs(run)["generated_tokens"] == pytest.approx(100.0)  # not 2 x 5 x 8 = 80


def test_experiment_costs_of_older_runs_fall_back_to_the_mean_length(tmp_path):
    run = _run_dir(tmp_path, [{"step": 1, "learn/response_length": 5.0}, {"step": 2, "learn/response_length": 2.0}])
    assert run_costs(run)["generated_tokens"] == pytest.approx((5.0 + 2.0) * 8)
