"""Multi-turn episodes wired into a run (issue 28): the data.env section, the environment's own examples,
episode scores, and an episode's trajectory.

    python -m pytest tests/unit/test_env_wiring.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, DataError
from megatron_rl.data.config import DataConfig
from megatron_rl.data.tasks import load_task
from megatron_rl.envs.chat_format import PLAIN_TEMPLATE
from megatron_rl.envs.config import EnvConfig
from megatron_rl.rollout.episodes import episode_score
from megatron_rl.rollout.sample import EpisodeSummary, PromptInfo, RolloutSample
from megatron_rl.train.config import load_train_config
from megatron_rl.sampling.scoring import to_trajectories
from megatron_rl.trajectory import validate

pytestmark = pytest.mark.unit

GUESS = ["data.task=env", "data.env.name=guess_number", "data.env.options={low: 1, high: 8, max_guesses: 3}",
         "data.env.chat_template=plain", "rollout.streaming=true", "rollout.max_model_len=256",
         "data.env.max_total_tokens=200", "sft.first=false"]


def test_a_run_with_an_environment_is_configured_under_data_env():
    cfg = load_train_config("configs/tiny_cpu.yaml", GUESS)
    assert cfg.data.env.enabled and cfg.data.env.limits().max_total_tokens == 200
    assert cfg.data.env.template == PLAIN_TEMPLATE
    assert not load_train_config("configs/tiny_cpu.yaml", ["sft.first=false"]).data.env.enabled
    rounds = load_train_config("configs/tiny_cpu.yaml", GUESS + ["rollout.streaming=false"])  # issue 45 item 5:
    assert rounds.data.env.enabled and not rounds.rollout.streaming  # the round engine plays episodes too


@pytest.mark.parametrize("override, words", [
    ("data.env.name=chess", "data.env.name 'chess' is not a known environment"),
    ("data.env.options={hgh: 3}", "unknown config key 'data.env.options.hgh'"),
    ("data.env.options={low: 5, high: 2}", "data.env.options: high must be > low"),
    ("data.env.max_turns=0", "data.env.max_turns must be an int >= 1"),
    ("data.env.max_total_tokens=300", "data.env.max_total_tokens (300) is more than rollout.max_model_len (256)"),
    ("data.env.chat_template=' '", "data.env.chat_template is empty"),
])
def test_bad_environment_settings_are_refused_by_name(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_train_config("configs/tiny_cpu.yaml", GUESS + [override])


def test_the_env_task_needs_an_environment_that_makes_examples():
    with pytest.raises(ConfigError, match="data.task 'env' takes its examples from the environment"):
        DataConfig(task="env")
    with pytest.raises(DataError, match="environment 'calculator' makes no examples of its own"):
        load_task(DataConfig(task="env", env=EnvConfig(name="calculator")))
    splits, template = load_task(DataConfig(task="env", train_size=20, holdout_size=5,
                                            env=EnvConfig(name="guess_number", options={"low": 1, "high": 8})))
    assert {k: len(v) for k, v in splits.items()} == {"train": 20, "dev": 5, "test": 5}
    ids = [ex.id for ds in splits.values() for ex in ds]
    assert len(set(ids)) == 30 and all(1 <= int(ex.answer) <= 8 for ex in splits["test"])
    assert template.render(splits["train"][0]) == splits["train"][0].question


def episode(reason: str, reward: float | None, error: str = "") -> EpisodeSummary:
    return EpisodeSummary(env="guess_number", terminal_reason=reason, reward=reward, error=error, turns=2,
                          tool_calls=0, tool_errors=0, step_seconds=[0.01])


def test_an_episode_is_scored_by_its_environment_and_a_failed_one_not_at_all():
    done, limit = episode_score(episode("done", 1.0)), episode_score(episode("max_turns", 0.0))
    assert (done.reward, done.correctness, done.format, done.components) == (1.0, 1.0, 1.0, {"env": 1.0})
    assert (limit.reward, limit.format, limit.ok) == (0.0, 0.0, True)
    partial = episode_score(episode("done", 0.5))  # partial credit: a reward, never a correctness
    assert (partial.reward, partial.correctness, partial.ok) == (0.5, None, True)
    timeout, error = episode_score(episode("timeout", None, "slow")), episode_score(episode("env_error", None, "x"))
    assert (timeout.ok, timeout.error, timeout.reward) == (False, "timeout", None)
    assert (error.ok, error.error, error.grader_version) == (False, "env_error", "env:guess_number")


def test_an_episode_becomes_a_trajectory_with_its_mask_segments_and_terminal_reason():
    # prompt 3 tokens; response: assistant 2 (v4), observation 3 (mask 0), assistant 2 (v5)
    sample = RolloutSample(prompt_tokens=[1, 5, 6], response_tokens=[7, 2, 9, 9, 9, 8, 2],
                           behavior_logprobs=[-0.5, -0.1, 0.0, 0.0, 0.0, -1.0, -0.2], policy_versions=[4, 4, 4, 4, 4, 5, 5],
                           action_mask=[1, 1, 0, 0, 0, 1, 1], sampling={"temperature": 1.0}, finish_reason="stop",
                           started_at=1.0, finished_at=2.0,
                           prompt=PromptInfo(id="p1", round=3), episode=episode("done", 1.0),
                           segments=[[0, 5, 4, 4], [5, 7, 5, 5]], weights={"4": "aa", "5": "bb"})
    sample.check()
    assert sample.generated_tokens == 4  # the observation's 3 tokens were not sampled
    [traj] = to_trajectories([sample], [episode_score(sample.episode)], tokenizer_hash="h", dataset_version="d")
    validate(traj, tokenizer_hash="h", current_version=5)
    assert traj.action_mask.tolist() == [1, 1, 0, 0, 0, 1, 1] and traj.terminal_reason == "done"
    assert traj.reward == 1.0 and traj.segments == [[0, 5, 4, 4], [5, 7, 5, 5]]
    with pytest.raises(ValueError, match="action_mask must hold 7 entries of 0 or 1"):
        RolloutSample.from_dict({**sample.to_dict(), "action_mask": [1, 0]}).check()
