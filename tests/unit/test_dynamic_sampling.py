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


def test_a_rounds_env_failed_groups_are_counted_and_never_kept():
    """Multi-turn rounds with dynamic sampling (sampling/rollout_source.py): a group whose environment failed
    at reset has no tokens to train on; it is left out of the selection, as a plain round leaves it out, and
    counted in env/dropped_groups (it was dropped uncounted)."""
    from megatron_rl.rollout.sample import EpisodeSummary
    from megatron_rl.sampling.rollout_source import RolloutSource, RoundSpec

    rewards = {"ok0": [0, 1], "bad": [None, None], "ok1": [1, 0], "flat": [1, 1], "ok2": [0, 1], "ok3": [1, 0]}

    class Prompts:
        def __init__(self):
            self.left = list(rewards)

        def next(self, r, k, examples):
            drawn, self.left = self.left[:k], self.left[k:]
            return drawn, drawn

    class Fleet:
        def generate(self, prompts, n, info, sampling, first_group, env):
            out = []
            for pid in prompts:
                for g in _group(pid, [r if r is not None else 0 for r in rewards[pid]]).samples:
                    if pid == "bad":  # an episode that ended at reset: no tokens, the environment's error
                        g.response_tokens, g.behavior_logprobs, g.policy_versions = [], [], []
                        g.episode = EpisodeSummary(env="e", terminal_reason="env_error", reward=None,
                                                   error="reset raised", turns=0, tool_calls=0, tool_errors=0,
                                                   step_seconds=[])
                    out.append(g)
            return out

    class Scorer:
        def grade(self, samples):
            return [_score(rewards[s.prompt.id][i % 2] or 0.0) for i, s in enumerate(samples)]

    source = RolloutSource.__new__(RolloutSource)
    source.fleet, source.prompts, source.scorer = Fleet(), Prompts(), Scorer()
    source.spec = RoundSpec(prompts_per_step=3, group_size=2, steps=1, seed=0, env={"name": "e"},
                            dynamic=DynamicSamplingConfig(enabled=True, oversample=1.0, max_attempts=3))
    samples, stats = source.sample_round(0)
    kept = [s.prompt.id for s in samples[::2]]
    assert kept == ["ok0", "ok1", "ok2"] and all(s.response_tokens for s in samples)
    assert stats["env/dropped_groups"] == 1 and stats["informative_groups"] == 3
    assert stats["sampled_groups"] == 4  # ok0, ok1, flat, ok2: the failed group was never a candidate
    source.spec = RoundSpec(prompts_per_step=3, group_size=2, steps=1, seed=0, env=None,
                            dynamic=DynamicSamplingConfig(enabled=True, oversample=1.0, max_attempts=3))
    source.prompts = Prompts()
    assert "env/dropped_groups" not in source.sample_round(0)[1]  # single-turn: no environment to count
