"""Checkpoint directory protocol: commit-last manifest, skipping incomplete dirs, checksums, rotation, RNG.

    python -m pytest tests/unit/test_checkpoint.py -q
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from megatron_rl import __version__
from megatron_rl.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_committed,
    list_step_dirs,
    load_checkpoint,
    load_rng_state,
    rotate,
    save_checkpoint,
)
from megatron_rl.rng_state import capture_rng_state, restore_rng_state

pytestmark = pytest.mark.unit


def _weights_fn(value: float):
    def save_fn(tmp_dir):
        (tmp_dir / "model").mkdir()
        torch.save({"w": torch.full((4,), value)}, tmp_dir / "model" / "weights.pt")
    return save_fn


def _save(run_dir, step, **kw):
    args = dict(policy_version=step, config_hash="cfg", save_fn=_weights_fn(float(step)), tokenizer_hash="tok")
    args.update(kw)
    return save_checkpoint(run_dir, step, **args)


def test_save_writes_manifest_last_with_checksums(tmp_path):
    seen_during_save = []

    def save_fn(tmp_dir):
        seen_during_save.append((tmp_dir.name.startswith(".tmp.step_000005."), latest_committed(tmp_path)))
        _weights_fn(5.0)(tmp_dir)

    path = save_checkpoint(tmp_path, 5, policy_version=2, config_hash="abc", save_fn=save_fn,
                           tokenizer_hash="tok", data_cursor={"epoch": 1, "index": 3},
                           coordinator_log_position=42, rng_states={0: capture_rng_state(), 1: capture_rng_state()})
    assert seen_during_save == [(True, None)]  # written in a hidden temp dir, invisible to readers
    assert path == tmp_path / "step_000005"
    manifest = load_checkpoint(path, tokenizer_hash="tok")
    assert manifest["step"] == 5 and manifest["policy_version"] == 2 and manifest["config_hash"] == "abc"
    assert manifest["package_version"] == __version__ and manifest["coordinator_log_position"] == 42
    assert manifest["data_cursor"] == {"epoch": 1, "index": 3} and manifest["rng"]["ranks"] == [0, 1]
    assert set(manifest["files"]) == {"model/weights.pt", "rng/rank_00000.json", "rng/rank_00001.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    with pytest.raises(FileExistsError, match="immutable"):
        _save(tmp_path, 5)


def test_latest_committed_skips_incomplete_and_corrupt(tmp_path, caplog):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    third = _save(tmp_path, 3)
    (third / MANIFEST).unlink()  # as if the process died before committing
    with caplog.at_level(logging.WARNING, logger="megatron_rl.checkpoint"):
        assert latest_committed(tmp_path) == tmp_path / "step_000002"
    assert any("step 3" in r.message and "not committed" in r.message for r in caplog.records)
    # Corrupt step 2's weights: plain lookup still returns it, verified lookup falls back.
    weights = tmp_path / "step_000002" / "model" / "weights.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="weights.pt fails its sha256"):
        load_checkpoint(tmp_path / "step_000002")
    assert latest_committed(tmp_path, verify=True) == tmp_path / "step_000001"
    # The crashed step can be saved again.
    assert _save(tmp_path, 3) == third and latest_committed(tmp_path) == third
    assert latest_committed(tmp_path / "missing") is None


def test_failing_save_fn_loses_nothing(tmp_path):
    _save(tmp_path, 1)

    def broken(tmp_dir):
        (tmp_dir / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, save_fn=broken)
    assert [s for s, _ in list_step_dirs(tmp_path)] == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert load_checkpoint(latest_committed(tmp_path))["step"] == 1


def test_tokenizer_mismatch_is_refused(tmp_path):
    path = _save(tmp_path, 1, tokenizer_hash="a" * 64)
    with pytest.raises(CheckpointError, match="different vocabulary"):
        load_checkpoint(path, tokenizer_hash="b" * 64)
    assert load_checkpoint(path, tokenizer_hash="a" * 64)["step"] == 1


def test_rotate_keeps_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    (tmp_path / "step_000002" / MANIFEST).unlink()  # incomplete, older than newest: removed
    stale_tmp = tmp_path / ".tmp.step_000001.abc"
    stale_tmp.mkdir()
    in_flight = tmp_path / ".tmp.step_000009.xyz"
    in_flight.mkdir()
    removed = rotate(tmp_path, keep_n=2)
    assert sorted(p.name for p in removed) == [".tmp.step_000001.abc", "step_000001", "step_000002"]
    assert [s for s, _ in list_step_dirs(tmp_path)] == [3, 4]
    assert in_flight.exists()
    with pytest.raises(ValueError, match="keep_n"):
        rotate(tmp_path, keep_n=0)


def test_rng_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    path = _save(tmp_path, 1, rng_states={0: state})
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    loaded = load_rng_state(path, 0)
    assert json.loads(json.dumps(loaded)) == loaded
    restore_rng_state(loaded)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    with pytest.raises(CheckpointError, match="rank 1"):
        load_rng_state(path, 1)


def test_unserialisable_manifest_fails_before_commit(tmp_path):
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        _save(tmp_path, 1, extra={"bad": object()})
    assert list(tmp_path.iterdir()) == []
