"""Dynamic sampling's selection rule and its accounting (sampling/dynamic_sampling.py, reporting/telemetry.py).

    python -m pytest tests/unit/test_dynamic_sampling.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.reward.math_verifier import Score
from megatron_rl.rollout.sample import PromptInfo, RolloutSample
from megatron_rl.sampling.dynamic_sampling import DynamicSamplingConfig, Group, fill, is_informative, select_groups
from megatron_rl.reporting.telemetry import Telemetry

pytestmark = pytest.mark.unit


def _score(reward):
    if reward is None:
        return Score.failed("timeout", "g1")
    return Score(reward=reward, correctness=reward, format=1.0, overlong=0.0, error=None, grader_version="g1")


def _group(pid, rewards, tokens=2):
    samples = [RolloutSample(prompt_tokens=[1], response_tokens=[5] * tokens, behavior_logprobs=[-0.5] * tokens,
                             policy_versions=[0] * tokens, sampling={}, finish_reason="stop", started_at=0.0,
                             finished_at=1.0, prompt=PromptInfo(id=pid)) for _ in rewards]
    return Group(pid, samples, [_score(r) for r in rewards])


def test_informative_means_graded_rewards_vary():
    assert is_informative([_score(0.0), _score(1.0)])
    assert not is_informative([_score(1.0)] * 4)
    assert not is_informative([_score(1.0), _score(None), _score(1.0)])  # the error is excluded, the rest agree
    assert not is_informative([_score(1.0), _score(None)])  # one graded member: no variance to speak of
    assert not is_informative([_score(0.0), _score(0.1)], min_reward_std=0.1)


def test_select_keeps_informative_groups_up_to_need_and_each_prompt_once():
    taken = {"p0"}
    groups = [_group("p0", [0, 1]), _group("p1", [1, 1]), _group("p2", [0, 1]), _group("p3", [1, 0]),
              _group("p4", [0, 1])]
    kept, discarded = select_groups(groups, need=2, taken=taken)
    assert [g.prompt_id for g in kept] == ["p2", "p3"]
    assert [g.prompt_id for g in discarded] == ["p0", "p1", "p4"]
    assert taken == {"p0", "p2", "p3"}


def test_fill_completes_the_round_or_says_why():
    taken = {"a"}
    kept = [_group("a", [0, 1])]
    filler = fill(kept, [_group("b", [1, 1]), _group("a", [0, 0]), _group("c", [0, 0])], need=3, taken=taken)
    assert [g.prompt_id for g in filler] == ["c", "b"]
    with pytest.raises(RuntimeError, match="could not fill a round: 1 of 3"):
        fill([_group("x", [0, 1])], [], need=3, taken=set())


@pytest.mark.parametrize("field,value,msg", [("oversample", 0.5, "oversample must be >= 1"),
                                             ("max_attempts", 0, "max_attempts must be >= 1"),
                                             ("min_reward_std", -1.0, "min_reward_std must be >= 0")])
def test_config_errors_name_the_field(field, value, msg):
    with pytest.raises(ConfigError, match=msg):
        DynamicSamplingConfig(**{field: value})
    assert DynamicSamplingConfig(oversample=1.5).prompts_to_draw(3) == 5


def test_discarded_tokens_count_against_esr():
    samples = [s for g in (_group("p", [0, 1], tokens=4),) for s in g.samples]  # 8 tokens kept
    learn = {"adv/informative_tokens": 8.0}
    phases = {"rollout": 1.0, "score": 0.1, "learn": 1.0}
    plain = Telemetry().step_metrics(samples, [], [], learn, phases, {}, {})
    ds = Telemetry().step_metrics(samples, [], [], learn, phases, {}, {}, sampling={
        "sampled_groups": 4, "informative_groups": 1, "filled_groups": 0, "discarded_tokens": 24, "attempts": 2})
    assert plain["system/esr"] == pytest.approx(1.0)
    assert ds["system/esr"] == pytest.approx(8 / 32)
    assert ds["system/generated_tokens_per_s"] == pytest.approx(32.0)
    assert ds["system/dynamic_kept_fraction"] == pytest.approx(0.25)
