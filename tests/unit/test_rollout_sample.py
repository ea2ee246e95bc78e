"""RolloutSample's typed fields (issue 45 item 3): what rides with a sample, through a checkpoint and back.

    python -m pytest tests/unit/test_rollout_sample.py -q

A checkpoint saves the rounds not yet learned from as JSON (sampling/producer.py Round.to_dict); loading
them must give back the same typed sample (its prompt's PromptInfo, the episode summary, the producer's
grade), and a checkpoint written when these rode in an untyped `extra` dict loads into the same fields.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.reward.math_verifier import Score
from megatron_rl.rollout.sample import EpisodeSummary, PromptInfo, RolloutSample
from megatron_rl.sampling.producer import Round
from megatron_rl.sampling.scoring import to_trajectories

pytestmark = pytest.mark.unit

EPISODE = EpisodeSummary(env="guess_number", terminal_reason="max_turns", reward=0.0, error="", turns=3,
                         tool_calls=1, tool_errors=0, step_seconds=[0.01, 0.02])
SCORE = Score(reward=0.0, correctness=0.0, format=0.0, overlong=None, error=None, grader_version="env:guess_number",
              components={"env": 0.0})


def _sample(**typed) -> RolloutSample:
    return RolloutSample(prompt_tokens=[1, 5], response_tokens=[7, 2, 9], behavior_logprobs=[-0.5, 0.0, -0.2],
                         policy_versions=[4, 4, 5], action_mask=[1, 0, 1], sampling={"seed": 3, "n": 2},
                         finish_reason="length", started_at=1.0, finished_at=2.0, **typed)


def test_a_pending_round_comes_back_from_its_json_with_typed_fields():
    sample = _sample(prompt=PromptInfo(id="p1", round=7, answer="5", fields={"x": [1]}, max_tokens=9),
                     weights={"4": "aa", "5": "bb"}, segments=[[0, 2, 4, 4], [2, 3, 5, 5]], episode=EPISODE,
                     score=SCORE)
    [back] = Round.from_dict(json.loads(json.dumps(Round(7, [sample], ["l0"], 1.5).to_dict()))).samples
    assert back == sample and isinstance(back.episode, EpisodeSummary) and isinstance(back.score, Score)
    plain = Round.from_dict(json.loads(json.dumps(Round(1, [_sample()], [], 0.0).to_dict()))).samples[0]
    assert plain == _sample() and plain.prompt == PromptInfo() and plain.episode is None and plain.score is None


def test_a_checkpoint_written_with_extra_loads_into_the_typed_fields():
    typed = _sample(prompt=PromptInfo(id="p1", round=7, answer="5", fields={"x": 1}),
                    weights={"4": "aa"}, segments=[[0, 3, 4, 4]], episode=EPISODE, score=SCORE)
    old = {**_sample().to_dict(), "extra": {"prompt_id": "p1", "round": 7, "answer": "5", "fields": {"x": 1},
                                            "weights": {"4": "aa"}, "segments": [[0, 3, 4, 4]], "n": 2,
                                            "episode": json.loads(json.dumps(EPISODE.__dict__)),
                                            "score": SCORE.to_dict(), "kv_versions": [4], "request_id": "r"}}
    for name in ("prompt", "weights", "segments", "episode", "score"):
        old.pop(name)
    assert RolloutSample.from_dict(old) == typed


def test_an_episode_s_trajectory_reads_its_summary_and_provenance():
    sample = _sample(prompt=PromptInfo(id="p1", round=7), weights={"4": "aa", "5": "bb"},
                     segments=[[0, 2, 4, 4], [2, 3, 5, 5]], episode=EPISODE)
    [traj] = to_trajectories([sample], [SCORE], tokenizer_hash="h", dataset_version="d")
    assert traj.id == "r000007/p1/0" and traj.terminal_reason == "max_turns"  # the episode's, not "length"
    assert traj.weights == {"4": "aa", "5": "bb"} and traj.segments == [[0, 2, 4, 4], [2, 3, 5, 5]]
    [single] = to_trajectories([_sample(prompt=PromptInfo(id="p2", round=0))], [SCORE], tokenizer_hash="h",
                               dataset_version="d")
    assert single.terminal_reason == "length" and single.weights == {} and single.segments == []
