"""Environments by name, the gymnasium-style text adapter, and environments that raise (issue 28).

    python -m pytest tests/unit/test_env_registry.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.envs.calculator import CalculatorConfig, CalculatorEnvironment
from megatron_rl.envs.chat_format import ChatFormat
from megatron_rl.envs.episode import trajectory_fields
from megatron_rl.envs.example import Example
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from megatron_rl.envs.gym_text import GymTextEnvironment
from megatron_rl.envs.protocol import EnvError, EpisodeLimits
from megatron_rl.envs.python_tool import PythonEnvironment
from megatron_rl.envs.registry import ENVIRONMENTS, get_environment
from megatron_rl.envs.runner import EpisodeRunner, run_episode
from tests.unit.tiny_chat import tiny_chat_tokenizer

def test_environments_by_name_with_their_config():
    assert sorted(ENVIRONMENTS) == ["calculator", "guess_number", "python"]
    assert isinstance(get_environment("calculator"), CalculatorEnvironment)
    env = get_environment("guess_number", {"low": 1, "high": 8, "max_guesses": 3})
    assert isinstance(env, GuessNumberEnvironment) and env.config.high == 8
    assert get_environment("guess_number", GuessNumberConfig(high=9)).config.high == 9
    python = get_environment("python", {"sandbox": {"cpu_seconds": 1, "memory_mb": 128}})
    assert isinstance(python, PythonEnvironment) and python.sandbox.config.memory_mb == 128


def test_bad_names_and_configs_are_clear_errors():
    with pytest.raises(ConfigError, match=r"unknown environment 'chess' \(data.env.name\); known: \['calculator', "
                                          r"'guess_number', 'python'\]"):
        get_environment("chess")
    with pytest.raises(ConfigError, match="unknown config key 'data.env.options.hgh'"):
        get_environment("guess_number", {"hgh": 10})
    with pytest.raises(ConfigError, match="high must be > low"):
        get_environment("guess_number", {"low": 10, "high": 3})
    with pytest.raises(ConfigError, match="network_isolation"):
        get_environment("python", {"sandbox": {"network_isolation": "firewall"}})
    with pytest.raises(ConfigError, match="takes a GuessNumberConfig or a mapping"):
        get_environment("guess_number", 7)


class WordGuess:
    """A gymnasium-style text game: guess the secret word; truncated after `limit` tries."""

    def __init__(self, limit=3):
        self.limit, self.closed, self.seeds = limit, False, []

    def reset(self, *, seed=None, options=None):
        self.seeds.append(seed)
        self.secret, self.tries = options["example"].answer, 0
        return f"Guess my {len(self.secret)}-letter word.", {}

    def step(self, action):
        self.tries += 1
        won = action.strip().endswith(self.secret)
        return ("You win." if won else "No."), float(won), won, self.tries >= self.limit, {"tries": self.tries}

    def close(self):
        self.closed = True


def _episode(env, turns, **limits):
    tok = tiny_chat_tokenizer()
    runner = EpisodeRunner(env, ChatFormat(tok, observation_role="user"), EpisodeLimits(**limits))
    queue = [tok(t + "<|im_end|>", add_special_tokens=False)["input_ids"] for t in turns]

    def generate(tokens, max_new):
        ids = queue.pop(0)
        return ids, [-1.0] * len(ids), 0
    return run_episode(runner, Example(id="w1", question="?", answer="cat"), generate)


def test_gym_style_text_environment_runs_as_an_episode():
    game = WordGuess()
    env = GymTextEnvironment(game, name="word_guess")
    ep = _episode(env, ["dog", "cat"])
    assert (ep.terminal_reason, ep.turns, ep.reward) == ("done", 2, 1.0)
    assert len(game.seeds) == 1 and isinstance(game.seeds[0], int)
    ep = _episode(GymTextEnvironment(WordGuess(limit=2)), ["dog", "cow"])
    assert (ep.terminal_reason, ep.reward) == ("done", 0.0)  # truncated by the game
    env.close()
    assert game.closed
    with pytest.raises(TypeError, match="not a gymnasium-style environment"):
        GymTextEnvironment(object())


def test_gym_seed_comes_from_the_example_id():
    a, b = WordGuess(), WordGuess()
    GymTextEnvironment(a).reset(Example(id="x", question="?", answer="cat"))
    GymTextEnvironment(b).reset(Example(id="x", question="?", answer="cat"))
    GymTextEnvironment(b).reset(Example(id="y", question="?", answer="cat"))
    assert a.seeds[0] == b.seeds[0] != b.seeds[1]


class Broken(WordGuess):
    def step(self, action):
        return 42  # not the gymnasium 5-tuple


def test_environments_that_raise_end_with_env_error_and_are_not_enqueued_as_zero():
    ep = _episode(GymTextEnvironment(Broken()), ["dog"])
    assert ep.terminal_reason == "env_error" and "EnvError" in ep.error and "step must return" in ep.error
    fields = trajectory_fields(ep)
    assert fields["status"] == "verifier_error" and fields["reward_components"] == {}
    with pytest.raises(EnvError, match="observations must be strings"):
        GymTextEnvironment(type("Numeric", (WordGuess,), {"reset": lambda self, **kw: (3, {})})()).reset(
            Example(id="x", question="?", answer="cat"))
    scorer_fails = CalculatorEnvironment(CalculatorConfig())
    scorer_fails.reset(Example(id="c", question="Calculate 1 + 1.", answer="2", metadata='{"no": "source"}'))
    with pytest.raises(ValueError, match="reasoning_gym reference must be a task entry"):
        scorer_fails.step("Answer: 2")  # the runner makes this env_error (tests/unit/test_env_episode.py)
