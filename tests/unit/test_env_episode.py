"""Multi-turn episodes (issue 28): one token sequence, its mask, limits and terminal reasons.

    python -m pytest tests/unit/test_env_episode.py -q
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from megatron_rl.envs.chat_format import ChatFormat
from megatron_rl.envs.episode import Episode, EpisodeError, trajectory_fields
from megatron_rl.envs.example import Example
from megatron_rl.envs.protocol import Environment, EpisodeLimits, StepResult
from megatron_rl.envs.runner import EpisodeRunner, run_episode
from megatron_rl.trajectory import make_trajectory, validate
from tests.unit.tiny_chat import tiny_chat_tokenizer

EXAMPLE = Example(id="e0", question="Say something.", answer="0")


def _finish_kwargs(fields: dict) -> dict:
    return dict(fields, id="run/e0/0", prompt_id="e0", dataset_version="d", tokenizer_hash="t",
                sampling_config={"temperature": 1.0}, grader_version="env@1", rollout_started_at=1.0, scored_at=2.0)


def test_mask_logprobs_and_versions_follow_the_segments():
    ep = Episode([5, 6, 7], max_total_tokens=32)
    ep.add_assistant([10, 11, 12], [-0.1, -0.2, -0.3], 3)
    ep.add_observation([20, 21])
    ep.add_assistant([13, 14], [-0.4, -0.5], [4, 4])  # a refit between the turns
    ep.add_reward(1.0)
    ep.finish("done")
    f = trajectory_fields(ep)
    assert f["prompt_tokens"].tolist() == [5, 6, 7]
    assert f["response_tokens"].tolist() == [10, 11, 12, 20, 21, 13, 14]
    assert f["action_mask"].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert np.allclose(f["behavior_logprobs"], [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    assert f["policy_versions"].tolist() == [3, 3, 3, 3, 3, 4, 4]
    assert ep.tokens == [5, 6, 7, 10, 11, 12, 20, 21, 13, 14] and ep.remaining_tokens == 22
    assert [(s.kind, s.start, s.end) for s in ep.segments] == [("assistant", 0, 3), ("observation", 3, 5),
                                                               ("assistant", 5, 7)]
    traj = make_trajectory(**_finish_kwargs(f))
    assert validate(traj, current_version=4) == (3, 4)
    assert traj.reward == 1.0 and traj.terminal_reason == "done" and traj.in_loss


def test_unscored_episodes_are_excluded_not_zero():
    for reason, status in (("env_error", "verifier_error"), ("timeout", "verifier_timeout")):
        ep = Episode([1], max_total_tokens=8)
        ep.add_assistant([2], [-1.0], 0)
        ep.finish(reason, error="tool broke")
        traj = make_trajectory(**_finish_kwargs(trajectory_fields(ep)))
        validate(traj)
        assert traj.status == status and traj.reward is None and not traj.in_loss
        assert "tool broke" in traj.error_code


def test_episode_misuse_is_a_clear_error():
    ep = Episode([1, 2], max_total_tokens=6)
    with pytest.raises(EpisodeError, match="must follow an assistant turn"):
        ep.add_observation([3])
    with pytest.raises(EpisodeError, match="exceeds the 4 left"):
        ep.add_assistant([3, 4, 5, 6, 7], [0.0] * 5, 0)
    with pytest.raises(EpisodeError, match="2 logprobs for 1 tokens"):
        ep.add_assistant([3], [0.0, 0.0], 0)
    with pytest.raises(EpisodeError, match="finite and <= 0"):
        ep.add_assistant([3], [0.5], 0)
    with pytest.raises(EpisodeError, match="not one of"):
        ep.finish("eos")
    with pytest.raises(EpisodeError, match="unfinished"):
        trajectory_fields(ep)
    with pytest.raises(EpisodeError, match="no room"):
        Episode([1, 2, 3], max_total_tokens=3)
    failed = Episode.failed_at_reset("reset raised KeyError")
    assert failed.terminal_reason == "env_error" and failed.reward is None
    with pytest.raises(EpisodeError, match="before any assistant token"):
        trajectory_fields(failed)


class Scripted(Environment):
    """Feedback "ok" each turn; `done_at` ends it with reward 1; `fail`/`slow` break the step."""

    name = "scripted"
    observation_role = "user"

    def __init__(self, done_at=None, fail=None, slow=None, observation="ok"):
        self.done_at, self.fail, self.slow, self.observation = done_at, fail, slow, observation
        self.turn = 0
        self.closed = False

    def reset(self, example):
        if self.fail == "reset":
            raise KeyError("no such example")
        self.turn = 0
        return example.question

    def step(self, action):
        self.turn += 1
        if self.fail == "step":
            raise ZeroDivisionError("tool crashed")
        if self.fail == "type":
            return "not a StepResult"
        if self.fail == "info":
            return StepResult("ok", info={"tool_calls": "many"})
        if self.slow:
            time.sleep(self.slow)
        if self.turn == self.done_at:
            return StepResult("", reward=1.0, done=True)
        return StepResult(self.observation)

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


def _policy(tok, text="guess 7", version=2):
    ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]

    def generate(tokens, max_new):
        out = ids[:max_new]
        return out, [-0.25] * len(out), version
    return generate


def _run(tok, env, **limits):
    runner = EpisodeRunner(env, ChatFormat(tok, observation_role="user"), EpisodeLimits(**limits))
    return run_episode(runner, EXAMPLE, _policy(tok)), runner


def test_terminal_reasons(tok):
    ep, _ = _run(tok, Scripted(done_at=2))
    assert (ep.terminal_reason, ep.turns, ep.reward) == ("done", 2, 1.0)
    ep, _ = _run(tok, Scripted(), max_turns=3)
    assert (ep.terminal_reason, ep.turns, ep.reward) == ("max_turns", 3, 0.0)
    assert [s.kind for s in ep.segments] == ["assistant", "observation"] * 2 + ["assistant"]
    ep, _ = _run(tok, Scripted(), max_turns=50, max_total_tokens=120)
    assert ep.terminal_reason == "max_tokens" and len(ep.tokens) <= 120 and ep.turns >= 2
    ep, _ = _run(tok, Scripted(fail="step"))
    assert ep.terminal_reason == "env_error" and "ZeroDivisionError: tool crashed" in ep.error
    ep, _ = _run(tok, Scripted(fail="type"))
    assert ep.terminal_reason == "env_error" and "not a StepResult" in ep.error
    ep, _ = _run(tok, Scripted(fail="reset"))
    assert ep.terminal_reason == "env_error" and "KeyError" in ep.error and not ep.tokens
    ep, _ = _run(tok, Scripted(fail="info"))
    assert ep.terminal_reason == "env_error" and "ValueError" in ep.error
    ep, _ = _run(tok, Scripted(), max_total_tokens=10)
    assert ep.terminal_reason == "env_error" and "no room under max_total_tokens=10" in ep.error


def test_a_slow_step_times_out_and_closes_the_environment(tok):
    env = Scripted(slow=2.0)
    start = time.monotonic()
    ep, _ = _run(tok, env, step_timeout_s=0.2)
    assert ep.terminal_reason == "timeout" and env.closed
    assert time.monotonic() - start < 1.5
    traj = make_trajectory(**_finish_kwargs(trajectory_fields(ep)))
    assert traj.status == "verifier_timeout" and not traj.in_loss


def test_observation_tokens_are_masked_and_earlier_turns_untouched(tok):
    ep, _ = _run(tok, Scripted(done_at=3))
    mask = np.asarray(ep.action_mask)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for seg in ep.segments:
        assert set(mask[seg.start:seg.end]) == {1 if seg.kind == "assistant" else 0}
        text = tok.decode(ep.response_tokens[seg.start:seg.end])
        if seg.kind == "assistant":
            assert text == "guess 7<|im_end|>" and ep.response_tokens[seg.end - 1] == im_end
        else:
            assert text == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    assert np.all(np.asarray(ep.behavior_logprobs)[mask == 0] == 0.0)
    assert ep.tokens[:len(ep.prompt_tokens)] == ChatFormat(tok, observation_role="user").prompt_tokens("Say something.")


def test_a_cut_off_turn_gets_its_end_of_turn_from_the_observation(tok):
    runner = EpisodeRunner(Scripted(), ChatFormat(tok, observation_role="user"), EpisodeLimits(max_turns=2))
    ep = runner.start(EXAMPLE)
    cut = tok("guess", add_special_tokens=False)["input_ids"]
    runner.assistant_turn(ep, cut, [-0.1] * len(cut), 0)
    obs = ep.response_tokens[ep.segments[1].start:ep.segments[1].end]
    assert tok.decode(obs).startswith("<|im_end|>\n<|im_start|>user\nok")


def test_episode_metrics_count_turns_tools_env_time_and_terminal_reasons(tok):
    from megatron_rl.envs.metrics import episode_metrics

    class Tooling(Scripted):
        def step(self, action):
            result = super().step(action)
            return StepResult(result.observation, result.reward, result.done,
                              info={"tool_calls": 2, "tool_errors": 1 if self.turn == 1 else 0})

    episodes = [_run(tok, Tooling(done_at=2))[0], _run(tok, Tooling(), max_turns=3)[0],
                _run(tok, Scripted(fail="step"))[0], _run(tok, Scripted(fail="reset"))[0]]
    m = episode_metrics(episodes)
    assert m["env/episodes"] == 4 and m["env/turns_mean"] == (2 + 3 + 1 + 0) / 4
    assert m["env/tool_calls_per_episode"] == (4 + 6) / 4
    assert m["env/tool_success_rate"] == pytest.approx(1 - 2 / 10)
    assert m["env/env_errors"] == 2
    assert (m["env/terminal/done"], m["env/terminal/max_turns"], m["env/terminal/env_error"]) == (0.25, 0.25, 0.5)
    assert m["env/terminal/timeout"] == 0 and 0 <= m["env/step_seconds/p50"] <= m["env/step_seconds/p99"] < 1
    assert episode_metrics([]) == {"env/episodes": 0.0}
    with pytest.raises(ValueError, match="unfinished"):
        episode_metrics([Episode([1], max_total_tokens=4)])
