"""Parallel checkpoint hashing equals the serial sha256, at save and at verification (issue 18).

    python -m pytest tests/unit/test_checkpoint_hashing.py -q
"""

import hashlib
import os

import pytest

from megatron_rl.checkpoint import CheckpointError, read_manifest, save_checkpoint, verify_files
from megatron_rl.durable_files import files_sha256

pytestmark = pytest.mark.unit

SIZES = {"a.bin": 0, "weights/b.distcp": 3 << 20, "weights/c.distcp": 1 << 20 | 17, "d.json": 5}


def _write(root):
    for i, (rel, size) in enumerate(SIZES.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size) if i % 2 else bytes([i]) * size)


def _serial(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_parallel_digests_equal_serial_in_order(tmp_path, workers):
    _write(tmp_path)
    paths = [tmp_path / rel for rel in SIZES]
    assert files_sha256(paths, workers=workers) == [_serial(p) for p in paths]


def test_save_records_serial_digests_and_verify_names_the_bad_file(tmp_path):
    ckpt = save_checkpoint(tmp_path / "run", 3, policy_version=1, config_hash="h", save_fn=_write)
    files = read_manifest(ckpt)["files"]
    for rel in SIZES:
        assert files[rel]["sha256"] == _serial(ckpt / rel)
    verify_files(ckpt, read_manifest(ckpt))
    bad = ckpt / "weights/c.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="weights/c.distcp fails its sha256"):
        verify_files(ckpt, read_manifest(ckpt))
