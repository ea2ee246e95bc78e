"""Multi-turn episodes on the round engine (rollout/turn_batcher.py, issue 45 item 5): the episode loop of
rollout/episodes.py, played in lockstep -- one engine call per turn of the episodes still playing.  The
engine is a test double that answers each turn with a scripted guess (the real round engine: the e2e test
tests/e2e/test_rollout.py::test_the_round_engine_plays_episodes).

    python -m pytest tests/unit/test_turn_batcher.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.example import Example
from megatron_rl.rollout.episodes import EpisodePlayer
from megatron_rl.rollout.stream_engine import Segment
from megatron_rl.rollout.turn_batcher import TurnBatcher, TurnResult

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def player(tmp_path_factory):
    from megatron_rl.models.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(d)
    env = EnvConfig(name="guess_number", options={"low": 1, "high": 8, "max_guesses": 3}, chat_template="plain",
                    system_prompt="", max_turns=3, max_total_tokens=200)
    return EpisodePlayer(env, str(d), max_tokens_per_turn=6)


class Engine:
    """Answers turn k of every episode with the guess script[k] (its tokens), version `version`; logs the calls."""

    def __init__(self, tokenizer, script: list[str], version: int = 3):
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.calls: list[list[str]] = []

    def __call__(self, turns):
        self.calls.append([t.request_id for t in turns])
        out = []
        for t in turns:
            turn = int(t.request_id.rsplit("-t", 1)[1])
            tokens = self.tokenizer.encode(self.script[turn], add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(TurnResult(t.request_id, t.tokens, tokens, [-0.5] * len(tokens), "stop",
                                  [Segment(0, len(tokens), self.version, self.version)],
                                  {str(self.version): "digest"}))
        return out


def _examples(answers):
    return [Example(id=f"e{a}", question="", answer=str(a)) for a in answers]


def test_episodes_advance_in_lockstep_one_engine_call_per_turn(player):
    engine = Engine(player.tokenizer, ["4", "6", "7"])
    batcher = TurnBatcher(engine)
    # hidden 4: right at turn 0; 6: turn 1; 7: turn 2; 1: wrong three times
    samples = batcher.play(player.episodes(batcher, "r", _examples([4, 6, 7, 1]), {"seed": 100, "temperature": 1.0},
                                           2, None, lambda result: result.weights))
    assert batcher.batches == [8, 6, 4], "a call per turn, each with every episode still playing"
    assert [len(c) for c in engine.calls] == [8, 6, 4]
    turns = [s.episode.turns for s in samples]
    assert turns == [1, 1, 2, 2, 3, 3, 3, 3]  # prompt-major: example i's two episodes at 2i, 2i+1
    assert [s.episode.reward for s in samples] == [1.0] * 6 + [0.0] * 2
    for s in samples:
        assert s.weights == {"3": "digest"} and set(s.policy_versions) == {3}
        assert sum(e - b for b, e, *_ in s.segments) == len(s.response_tokens) and s.segments[0][2:] == [3, 3]
        observed = len(s.response_tokens) - s.generated_tokens  # the environment's feedback between turns: mask 0
        assert (observed > 0) == (s.episode.turns > 1), (s.episode.turns, s.action_mask)
    seeds = [s.sampling["seed"] for s in samples]
    assert seeds == [100 + k for k in range(8)]  # seeded as the streaming engine's episodes


def test_an_engine_error_fails_every_episode_of_the_batch_and_hangs_none(player):
    def broken(turns):
        raise RuntimeError("engine core died")

    batcher = TurnBatcher(broken)
    with pytest.raises(RuntimeError, match="engine core died"):
        batcher.play(player.episodes(batcher, "r", _examples([4, 6]), {"seed": 1}, 2, None, lambda r: r.weights))


def test_a_short_answer_from_the_engine_is_an_error_not_a_hang(player):
    batcher = TurnBatcher(lambda turns: [])
    with pytest.raises(RuntimeError, match="answered 0 of 2 turns"):
        batcher.play(player.episodes(batcher, "r", _examples([4]), {"seed": 1}, 2, None, lambda r: r.weights))
