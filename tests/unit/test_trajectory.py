"""The trajectory contract: construction, checksum, wire format, and every rejection reason.

    python -m pytest tests/unit/test_trajectory.py -q
"""

import dataclasses
import pickle

import numpy as np
import pytest

from megatron_rl.trajectory import (
    REJECT_REASONS, Trajectory, TrajectoryError, checksum_of_wire, make_trajectory, validate,
)

pytestmark = pytest.mark.unit
TOK = "f" * 64


def traj(**overrides):
    fields = dict(id="t0", prompt_id="p0", dataset_version="d@1", policy_versions=[3, 3, 4], tokenizer_hash=TOK,
                  prompt_tokens=[1, 5, 9], response_tokens=[7, 8, 2], behavior_logprobs=[-0.1, -2.0, -0.5],
                  sampling_config={"temperature": 0.7}, reward_components={"correct": 1.0, "format": -0.25},
                  grader_version="math@2", terminal_reason="eos", rollout_started_at=100.0, scored_at=101.5)
    fields.update(overrides)
    return make_trajectory(**fields)


def rebuilt(t, **changes):
    """Change fields WITHOUT recomputing the checksum (what a buggy producer would send)."""
    return dataclasses.replace(t, **changes)


def resealed(t, **changes):
    t = dataclasses.replace(t, **changes)
    return dataclasses.replace(t, checksum=t.compute_checksum())


def test_make_trajectory_canonical_and_valid():
    t = traj()
    assert t.prompt_tokens.dtype == np.int32 and t.behavior_logprobs.dtype == np.float32
    assert t.action_mask.tolist() == [1, 1, 1]
    assert t.oldest_version == 3 and t.num_tokens == 6
    assert t.reward == pytest.approx(0.75) and t.in_loss
    validate(t, tokenizer_hash=TOK, current_version=4)


def test_scalar_policy_version_broadcasts():
    assert traj(policy_versions=5).policy_versions.tolist() == [5, 5, 5]


def test_wire_roundtrip_and_pickle():
    t = dataclasses.replace(traj(), sampling_probability=0.125)
    for back in (Trajectory.from_bytes(t.to_bytes()), pickle.loads(pickle.dumps(t))):
        for f in dataclasses.fields(Trajectory):
            a, b = getattr(t, f.name), getattr(back, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), f.name
            else:
                assert a == b, f.name
        validate(back, tokenizer_hash=TOK)
    assert checksum_of_wire(t.to_bytes()) == t.compute_checksum() == t.checksum


def test_checksum_covers_content_but_not_sampling_probability():
    t = traj()
    assert dataclasses.replace(t, sampling_probability=0.3).compute_checksum() == t.checksum
    assert rebuilt(t, sampling_config={"temperature": 1.0}).compute_checksum() != t.checksum
    assert rebuilt(t, response_tokens=np.array([7, 8, 3], np.int32)).compute_checksum() != t.checksum


def test_verifier_timeout_is_not_a_zero_reward():
    t = traj(status="verifier_timeout", error_code="grader timed out after 30 s", reward_components={})
    validate(t, tokenizer_hash=TOK)
    assert t.reward is None and not t.in_loss


BAD = {
    "length": lambda t: resealed(t, policy_versions=np.array([3, 3], np.int32)),
    "nonfinite_logprobs": lambda t: resealed(t, behavior_logprobs=np.array([-0.1, np.nan, -1], np.float32)),
    "positive_logprobs": lambda t: resealed(t, behavior_logprobs=np.array([-0.1, 0.5, -1], np.float32)),
    "checksum": lambda t: rebuilt(t, response_tokens=np.array([7, 8, 3], np.int32)),
    "tokenizer": lambda t: resealed(t, tokenizer_hash="0" * 64),
    "version": lambda t: resealed(t, policy_versions=np.array([3, -1, 4], np.int32)),
    "status": lambda t: resealed(t, status="verifier_timeout"),  # no error_code
    "schema": lambda t: rebuilt(t, prompt_tokens=np.array([1, 5, 9], np.int64)),
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_bad_kind_is_rejected_with_its_reason(reason):
    bad = BAD[reason](traj())
    with pytest.raises(TrajectoryError) as info:
        validate(bad, tokenizer_hash=TOK, current_version=10)
    assert info.value.reason == reason and reason in REJECT_REASONS
    assert "'t0'" in str(info.value)  # the message names the trajectory


@pytest.mark.parametrize("bad", [
    dict(behavior_logprobs=[-0.1, -np.inf, -1.0]),
    dict(action_mask=[1, 1]),
    dict(response_tokens=[], policy_versions=[], behavior_logprobs=[]),
])
def test_more_rejections(bad):
    with pytest.raises(TrajectoryError):
        validate(traj(**bad), tokenizer_hash=TOK)


def test_future_policy_version_rejected():
    with pytest.raises(TrajectoryError, match="newer than the learner's 3") as info:
        validate(traj(), tokenizer_hash=TOK, current_version=3)
    assert info.value.reason == "version"


def test_ok_status_needs_finite_reward():
    for rewards in ({}, {"correct": float("nan")}):
        with pytest.raises(TrajectoryError) as info:
            validate(traj(reward_components=rewards), tokenizer_hash=TOK)
        assert info.value.reason == "status"


def test_not_a_trajectory_and_corrupt_bytes():
    with pytest.raises(TrajectoryError, match="expected a Trajectory"):
        validate({"id": "x"})
    blob = traj().to_bytes()
    for broken in (blob[:10], b"XXXX" + blob[4:], blob[:-3], blob + b"\0"):
        with pytest.raises(TrajectoryError) as info:
            Trajectory.from_bytes(broken)
        assert info.value.reason == "schema"
