"""A damaged checkpoint is found before anything starts, and resume falls back past it (issue #12).

    python -m pytest tests/unit/test_checkpoint_verify.py -q

Real step directories written by save_checkpoint; the damage is done by hand (bytes flipped,
a file truncated, COMMITTED deleted).  Also: `checkpoint verify`, the dry-run plan's
resume_from, the live queue.db never taken from a bad checkpoint, run.dir and weight files
checked by `train --dry-run`.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3

import pytest
import torch

from megatron_rl.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_status,
    quarantine_newer,
    resume_checkpoint,
    save_checkpoint,
)
from megatron_rl.cli import main
from megatron_rl.train.config import load_train_config
from megatron_rl.train.dry_run import check_and_plan, check_safetensors
from megatron_rl.train.checkpointing import QUEUE_DB, QUEUE_SNAPSHOT, restore_queue_snapshot
from megatron_rl.train.resume import choose_resume
from tests.e2e.conftest import TINY

pytestmark = pytest.mark.unit


def _queue_db(path, marker: str):
    with sqlite3.connect(str(path)) as db:
        db.execute("CREATE TABLE t (marker TEXT)")
        db.execute("INSERT INTO t VALUES (?)", (marker,))


def _marker(path) -> str:
    with sqlite3.connect(str(path)) as db:
        return db.execute("SELECT marker FROM t").fetchone()[0]


def _run_with_two_checkpoints(run_dir):
    ckpts = run_dir / "checkpoints"
    for step in (2, 4):
        def save_fn(tmp, step=step):
            (tmp / "weights").mkdir()
            torch.save({"w": torch.full((64,), float(step))}, tmp / "weights" / "model.pt")
            _queue_db(tmp / QUEUE_SNAPSHOT, f"queue of step {step}")
        save_checkpoint(ckpts, step, policy_version=step, config_hash="x", save_fn=save_fn)
    return ckpts


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": lambda c: _flip(c / "weights" / "model.pt"),
    "truncated": lambda c: (c / QUEUE_SNAPSHOT).write_bytes((c / QUEUE_SNAPSHOT).read_bytes()[:100]),
    "uncommitted": lambda c: (c / MANIFEST).unlink(),
}
BAD_FILE = {"flipped": "weights/model.pt", "truncated": QUEUE_SNAPSHOT, "uncommitted": MANIFEST}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_falls_back_to_newest_intact_and_names_the_file(tmp_path, caplog, kind):
    ckpts = _run_with_two_checkpoints(tmp_path)
    DAMAGE[kind](ckpts / "step_000004")
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint(ckpts) == ckpts / "step_000002"
    assert BAD_FILE[kind] in caplog.text and "step 4" in caplog.text
    rows = checkpoint_status(ckpts)
    assert [(r["step"], r["status"]) for r in rows] == [(4, "uncommitted" if kind == "uncommitted" else "corrupt"),
                                                       (2, "intact")]
    assert BAD_FILE[kind] in rows[0]["problem"]


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    ckpts = _run_with_two_checkpoints(tmp_path)
    for step in ("step_000002", "step_000004"):
        _flip(ckpts / step / "weights" / "model.pt")
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        resume_checkpoint(ckpts)
    assert resume_checkpoint(tmp_path / "nothing_here") is None


def test_quarantine_sets_aside_newer_step_dirs(tmp_path):
    ckpts = _run_with_two_checkpoints(tmp_path)
    _flip(ckpts / "step_000004" / "weights" / "model.pt")
    moved = quarantine_newer(ckpts, 2)
    assert [p.name.startswith("bad.step_000004.") for p in moved] == [True]
    assert [r["step"] for r in checkpoint_status(ckpts)] == [2]


def test_live_queue_is_never_restored_from_a_bad_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = _run_with_two_checkpoints(run_dir)
    _flip(ckpts / "step_000004" / "weights" / "model.pt")  # the snapshot itself is fine: the checkpoint is not
    cfg = load_train_config(TINY, [f"run.dir={run_dir}"])
    resume_from = choose_resume(cfg)
    assert resume_from == ckpts / "step_000002"
    restore_queue_snapshot(run_dir, resume_from)
    assert _marker(run_dir / QUEUE_DB) == "queue of step 2"


def test_nothing_restored_when_no_checkpoint_verifies(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = _run_with_two_checkpoints(run_dir)
    for step in ("step_000002", "step_000004"):
        _flip(ckpts / step / "weights" / "model.pt")
    _queue_db(run_dir / QUEUE_DB, "live")
    cfg = load_train_config(TINY, [f"run.dir={run_dir}"])
    with pytest.raises(CheckpointError):
        restore_queue_snapshot(run_dir, choose_resume(cfg))
    assert _marker(run_dir / QUEUE_DB) == "live"


def test_dry_run_plan_resumes_from_the_newest_intact(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = _run_with_two_checkpoints(run_dir)
    cfg = load_train_config(TINY, [f"run.dir={run_dir}"])
    assert check_and_plan(cfg)["resume_from"] == str(ckpts / "step_000004")
    _flip(ckpts / "step_000004" / "weights" / "model.pt")
    assert check_and_plan(cfg)["resume_from"] == str(ckpts / "step_000002")


def test_checkpoint_verify_cli(tmp_path, capsys):
    ckpts = _run_with_two_checkpoints(tmp_path / "run")
    assert main(["checkpoint", "verify", str(tmp_path / "run")]) == 0
    assert "intact" in capsys.readouterr().out
    DAMAGE["truncated"](ckpts / "step_000004")
    (ckpts / "step_000006").mkdir()  # a save that never finished
    assert main(["checkpoint", "verify", str(tmp_path / "run"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in report["checkpoints"]] == [
        (6, "uncommitted"), (4, "corrupt"), (2, "intact")]
    assert QUEUE_SNAPSHOT in report["checkpoints"][1]["problem"]
    assert report["resume_from"] == str(ckpts / "step_000002") and report["newest_intact"] is False


# ---- inputs train --dry-run (and so the real run, which plans first) must refuse -----------------


def _tiny_model(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "model", arch="llama", seed=0)


def test_truncated_safetensors_is_refused_naming_the_file(tmp_path, capsys):
    model = _tiny_model(tmp_path)
    weights = sorted(model.glob("*.safetensors"))
    assert weights
    check_safetensors(weights[0])  # intact: passes
    weights[0].write_bytes(weights[0].read_bytes()[: weights[0].stat().st_size - 1000])
    args = ["train", "--dry-run", "--config", str(TINY), f"run.dir={tmp_path / 'run'}", f"model.path={model}",
            "model.tiny=null"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(weights[0]) in err and "truncated" in err


def test_cut_inside_the_header_is_refused(tmp_path):
    model = _tiny_model(tmp_path)
    f = sorted(model.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(ValueError, match=str(f)):
        check_safetensors(f)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "real"])
def test_run_dir_that_cannot_be_a_directory(capsys, dry_run):
    args = ["train", "--config", str(TINY), "run.dir=/dev/null/x"] + (["--dry-run"] if dry_run else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "run.dir /dev/null/x" in err and "not a directory" in err


def test_run_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["train", "--dry-run", "--config", str(TINY), f"run.dir={tmp_path / 'f'}"]) == 2
    assert "run.dir" in capsys.readouterr().err


def test_copied_run_dir_reverifies(tmp_path):
    ckpts = _run_with_two_checkpoints(tmp_path / "a")
    assert resume_checkpoint(ckpts) == ckpts / "step_000004"
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copy2)
    other = tmp_path / "b" / "checkpoints"
    _flip(other / "step_000004" / "weights" / "model.pt")
    assert resume_checkpoint(other) == other / "step_000002"


def test_live_queue_kept_when_the_checkpoint_has_another_tokenizer(tmp_path):
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints", 2, policy_version=2, config_hash="x", tokenizer_hash="a" * 64,
                    save_fn=lambda d: _queue_db(d / QUEUE_SNAPSHOT, "queue of step 2"))
    _queue_db(run_dir / QUEUE_DB, "live")
    cfg = load_train_config(TINY, [f"run.dir={run_dir}"])
    with pytest.raises(CheckpointError, match="tokenizer"):
        restore_queue_snapshot(run_dir, choose_resume(cfg), tokenizer_hash="b" * 64)
    assert _marker(run_dir / QUEUE_DB) == "live"
