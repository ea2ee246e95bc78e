"""SFT on multi-turn episodes: the environment's expert plays (envs/demonstrations.py), token-in/token-out, and
the loss covers the assistant tokens only."""

from __future__ import annotations

import pytest

from megatron_rl.config import from_dict
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.demonstrations import Demonstrations, episode_sft_batch
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from tests.unit.tiny_chat import tiny_chat_tokenizer

pytestmark = pytest.mark.unit

GUESS = {"name": "guess_number", "options": {"low": 1, "high": 8, "max_guesses": 3}}


def test_the_guess_number_expert_is_binary_search():
    """It wins every game its guesses allow (2^k - 1 numbers in k guesses), using the feedback it got."""
    for high, guesses in ((7, 3), (8, 3), (100, 7)):
        env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=high, max_guesses=guesses))
        won = 0
        for hidden in range(1, high + 1):
            (example,) = env.make_examples(1, seed=0)
            example = type(example)(id=example.id, question=example.question, answer=str(hidden))
            env.reset(example)
            while True:
                result = env.step(env.expert())
                if result.done:
                    won += result.reward == 1.0
                    break
        assert won == min(high, 2 ** guesses - 1), (high, guesses, won)


def test_an_environment_without_an_expert_says_so():
    from megatron_rl.config import ConfigError
    from megatron_rl.envs.registry import get_environment

    env = get_environment("calculator", None)
    with pytest.raises(NotImplementedError, match="environment 'calculator' has no expert"):
        env.expert()
    cfg = from_dict(EnvConfig, {"name": "calculator"}, where="data.env")
    with pytest.raises(ConfigError, match="data.env.name 'calculator': this environment has no expert"):
        Demonstrations(cfg, tiny_chat_tokenizer())  # before SFT starts anything


def _demos():
    return Demonstrations(from_dict(EnvConfig, GUESS, where="data.env"), tiny_chat_tokenizer())


def test_a_demonstration_is_a_training_episode_played_by_the_expert():
    demos = _demos()
    env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=8, max_guesses=3))
    (example,) = env.make_examples(1, seed=0)
    example = type(example)(id=example.id, question=example.question, answer="3")
    ep = demos.play(example)
    assert ep.terminal_reason == "done" and ep.reward == 1.0 and ep.turns == 3  # 4 (lower), 2 (higher), 3
    tok = demos.tokenizer
    turns = [[t for t, m in zip(ep.response_tokens[s.start:s.end], ep.action_mask[s.start:s.end])]
             for s in ep.segments if s.kind == "assistant"]
    assert [tok.decode(t, skip_special_tokens=True) for t in turns] == ["4", "2", "3"]
    assert all(t[-1] == demos.chat.end_of_turn_id for t in turns)  # each turn ends as a sampled one does
    # token-in/token-out: the same conversation rendered by the chat template gives the same tokens
    messages = demos.chat.messages(example.question)
    for text, obs in zip(["4", "2", "3"], ["lower", "higher", None]):
        messages.append({"role": "assistant", "content": text})
        if obs is not None:
            messages.append({"role": "user", "content": obs})
    rendered = demos.chat.render(messages, add_generation_prompt=False, tokenize=True)
    rendered = [int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)]
    assert rendered[:len(ep.tokens)] == ep.tokens


def test_the_sft_batch_of_episodes_learns_assistant_tokens_only():
    demos = _demos()
    env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=8, max_guesses=3))
    episodes = [demos.play(ex) for ex in env.make_examples(4, seed=1)]
    batch = episode_sft_batch(episodes, pad_id=0, micro_batch_size=2)
    assert batch["tokens"].shape[0] == 4 and batch["loss_mask"].shape[1] == batch["tokens"].shape[1] - 1
    for i, ep in enumerate(episodes):
        p, n = len(ep.prompt_tokens), len(ep.response_tokens)
        mask = batch["loss_mask"][i]
        assert mask[:p - 1].sum() == 0 and mask[p - 1 + n:].sum() == 0  # no loss on the prompt or the padding
        assert mask[p - 1:p - 1 + n].tolist() == [float(m) for m in ep.action_mask]  # observations masked
        assert batch["tokens"][i, :p + n].tolist() == ep.tokens
    assert batch["tokens_in_loss"] == sum(sum(ep.action_mask) for ep in episodes)
    assert 0 < batch["tokens_in_loss"] < sum(len(ep.response_tokens) for ep in episodes)
