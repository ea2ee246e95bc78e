"""Sampling settings: what the learner cannot score is refused with the field named, and
trajectories sampled under other settings never reach a learner step.

    python -m pytest tests/unit/test_sampling_config.py -q

Config cases run the real CLI entry point in-process with --dry-run (nothing is started).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.learner.config import SamplingConfig
from megatron_rl.train.config import load_train_config
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.yaml")


def dry_run(capsys, *overrides: str) -> tuple[int, str]:
    code = main(["train", "--config", TINY, "--dry-run", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.temperature=0"], "rollout.temperature"),                       # greedy: nothing to score
    (["rollout.temperature=0.000001"], "rollout.temperature"),                # vLLM treats it as greedy
    (["rollout.logprobs_mode=raw_logprobs", "rollout.temperature=0.7"], "rollout.logprobs_mode"),
    (["rollout.logprobs_mode=raw_logprobs", "rollout.top_p=0.9"], "rollout.logprobs_mode"),
    (["rollout.logprobs_mode=raw_logprobs", "rollout.top_k=5"], "rollout.logprobs_mode"),
    (["rollout.engine_options.logprobs_mode=raw_logprobs"], "rollout.engine_options.logprobs_mode"),
])
def test_unscorable_sampling_is_refused_with_the_field(capsys, overrides, needle):
    code, err = dry_run(capsys, *overrides)
    assert code == 2
    assert needle in err, err


@pytest.mark.parametrize("overrides", [
    ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20"],
    ["rollout.logprobs_mode=raw_logprobs"],  # temperature 1, no truncation: raw == processed
])
def test_scorable_sampling_is_accepted(capsys, tmp_path, overrides):
    code, err = dry_run(capsys, f"run.dir={tmp_path}", *overrides)
    assert code == 0, err


def test_learner_sampling_takes_the_rollout_numbers():
    cfg = load_train_config(TINY, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20"])
    assert cfg.sampling == SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)
    assert cfg.sampling.truncates and not load_train_config(TINY).sampling.truncates


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 0.0}, "sampling.temperature"),
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"top_k": 2.5}, "sampling.top_k"),
])
def test_sampling_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def _traj(i: int, sampling: dict):
    return make_trajectory(id=f"r0/p{i}/0", prompt_id=f"p{i}", dataset_version="d@1", policy_versions=0,
                           tokenizer_hash="f" * 64, prompt_tokens=[1, 2], response_tokens=[3],
                           behavior_logprobs=[-0.5], sampling_config=sampling, reward_components={"correctness": 1.0},
                           grader_version="g", terminal_reason="stop", rollout_started_at=0.0, scored_at=0.0)


def test_take_refuses_trajectories_sampled_under_other_settings():
    from megatron_rl.train.policy import check_sampling

    learner = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)
    # What the rollout worker records: every SamplingParams field it passed, plus n.
    same = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 2, "seed": 3, "n": 8}
    check_sampling([_traj(0, same), _traj(1, same)], learner)
    for other in ({**same, "top_p": 1.0}, {**same, "temperature": 1.0}, {**same, "top_k": 0},
                  {**same, "temperature": 0.0},  # an eval (greedy) sample, were one ever queued
                  {"temperature": 0.7}):         # settings not recorded
        with pytest.raises(RuntimeError, match="r0/p1/0 was sampled with"):
            check_sampling([_traj(0, same), _traj(1, other)], learner)
