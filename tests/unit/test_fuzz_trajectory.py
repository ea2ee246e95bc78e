"""Fuzz (hypothesis) of the trajectory wire format: bad bytes get a TrajectoryError, nothing else.

    python -m pytest tests/unit/test_fuzz_trajectory.py -q

A blob from a rollout worker (or a WAL row) goes through `Trajectory.from_bytes`, then
`validate`.  For arbitrary bytes, damaged copies of a valid blob and well-framed blobs with
arbitrary JSON metadata, each step either succeeds or raises TrajectoryError with one of
REJECT_REASONS; a record that validates can be re-encoded and has a usable reward.  The
regression tests below pin the inputs that once escaped with another exception.
"""

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl.trajectory import (REJECT_REASONS, Trajectory, TrajectoryError, checksum_of_wire,
                                    make_trajectory, validate)
from tests.unit.fuzz_common import FUZZ, JSON_VALUES, mutate

pytestmark = pytest.mark.unit
TOK = "f" * 64
HEADER = struct.Struct("<4sIIII")


def good(**overrides):
    fields = dict(id="run/p1/s0", prompt_id="p1", dataset_version="d@1", policy_versions=3, tokenizer_hash=TOK,
                  prompt_tokens=[5, 6, 7], response_tokens=[8, 9], behavior_logprobs=[-0.5, -1.5],
                  reward_components={"correct": 1.0}, grader_version="g", terminal_reason="eos",
                  rollout_started_at=1.0, scored_at=2.0)
    fields.update(overrides)
    return make_trajectory(**fields)


def frame(meta: bytes, extra: bytes, p: int, r: int, arrays: bytes) -> bytes:
    return HEADER.pack(b"MRT1", len(meta), len(extra), p, r) + meta + extra + arrays


def decode_and_validate(blob: bytes) -> None:
    """The contract: TrajectoryError (with a known reason) or a usable trajectory."""
    try:
        checksum_of_wire(blob)
        traj = Trajectory.from_bytes(blob)
        validate(traj, tokenizer_hash=TOK, current_version=10)
    except TrajectoryError as err:
        assert err.reason in REJECT_REASONS and str(err)
        return
    assert Trajectory.from_bytes(traj.to_bytes()).checksum == traj.checksum
    assert traj.reward is None or np.isfinite(traj.reward)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes(blob):
    decode_and_validate(blob)


@FUZZ
@given(st.data())
def test_damaged_valid_blob(data):
    blob = good().to_bytes()
    for _ in range(data.draw(st.integers(1, 3))):
        blob = mutate(blob, data)
    decode_and_validate(blob)


META_KEYS = ["id", "prompt_id", "dataset_version", "tokenizer_hash", "grader_version", "terminal_reason",
             "rollout_started_at", "scored_at", "status", "error_code", "source", "priority", "sampling_config",
             "reward_components"]


@FUZZ
@given(st.data())
def test_well_framed_blob_with_arbitrary_metadata(data):
    meta = _meta_of(good())
    for key in data.draw(st.lists(st.sampled_from(META_KEYS + ["bogus"]), max_size=3)):
        if data.draw(st.booleans()):
            meta[key] = data.draw(JSON_VALUES)
        else:
            meta.pop(key, None)
    extra = data.draw(st.one_of(st.just([good().checksum, None]), JSON_VALUES))
    p, r = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    arrays = (np.asarray(data.draw(st.lists(st.integers(-5, 2**31 - 1), min_size=p, max_size=p)), np.int32).tobytes()
              + np.asarray(data.draw(st.lists(st.integers(-5, 50), min_size=r, max_size=r)), np.int32).tobytes()
              + np.asarray(data.draw(st.lists(st.integers(-2, 12), min_size=r, max_size=r)), np.int32).tobytes()
              + np.asarray(data.draw(st.lists(st.floats(width=32), min_size=r, max_size=r)), np.float32).tobytes()
              + bytes(data.draw(st.lists(st.integers(0, 255), min_size=r, max_size=r))))
    decode_and_validate(frame(json.dumps(meta).encode(), json.dumps(extra).encode(), p, r, arrays))


def _meta_of(traj):
    blob = traj.to_bytes()
    _, checked_len, _, _, _ = HEADER.unpack_from(blob)
    return json.loads(blob[HEADER.size:HEADER.size + checked_len])


# ------------------------------------------------------------------ regressions (found by the fuzz)

def reframed(**meta_changes):
    meta = _meta_of(good())
    meta.update(meta_changes)
    t = good()
    arrays = b"".join(np.ascontiguousarray(getattr(t, n)).tobytes() for n in
                      ("prompt_tokens", "response_tokens", "policy_versions", "behavior_logprobs", "action_mask"))
    return frame(json.dumps(meta).encode(), json.dumps([t.checksum, None]).encode(), 3, 2, arrays)


@pytest.mark.parametrize("blob, reason", [
    # json.loads raised RecursionError on deeply nested metadata.
    (frame(b"[" * 100_000 + b"]" * 100_000, b"[]", 0, 0, b""), "schema"),
    # math.isfinite(10**400) raised OverflowError in validate (and float() in .reward).
    (reframed(priority=10**400), "schema"),
    (reframed(scored_at=10**400), "schema"),
    (reframed(reward_components={"r": 10**400}), "status"),
])
def test_regressions_raise_trajectory_error(blob, reason):
    with pytest.raises(TrajectoryError) as info:
        validate(Trajectory.from_bytes(blob), tokenizer_hash=TOK)
    assert info.value.reason == reason


def test_negative_token_ids_and_non_binary_mask_are_schema_errors():
    with pytest.raises(TrajectoryError, match="prompt_tokens"):
        validate(good(prompt_tokens=[5, -1, 7]), tokenizer_hash=TOK)
    with pytest.raises(TrajectoryError, match="action_mask"):
        validate(good(action_mask=[1, 2]), tokenizer_hash=TOK)
    # sampling_probability was never checked: a string would have reached the learner.
    with pytest.raises(TrajectoryError, match="sampling_probability"):
        validate(Trajectory.from_bytes(reframed_probability("half")), tokenizer_hash=TOK)


def reframed_probability(p):
    t = good()
    blob = t.to_bytes()
    _, checked_len, extra_len, _, _ = HEADER.unpack_from(blob)
    extra = json.dumps([t.checksum, p]).encode()
    start = HEADER.size + checked_len
    return HEADER.pack(b"MRT1", checked_len, len(extra), 3, 2) + blob[HEADER.size:start] + extra + \
        blob[start + extra_len:]
