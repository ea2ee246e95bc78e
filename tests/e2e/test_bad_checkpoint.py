"""The bad_checkpoint drill (issue #12): a damaged checkpoint is skipped, never loaded.

    python -m pytest tests/e2e/test_bad_checkpoint.py -q

One real tiny run of 4 steps leaves a checkpoint at every step: the worker_crash drill's run
(tests/e2e/conftest.py), whose steps 1-4 are those of an uninterrupted run (resume is exact,
tests/e2e/test_drills.py), so no start-up of its own.  Three kinds of damage: (a) bytes
flipped in a weights file, (b) queue_snapshot.db truncated, (c) COMMITTED deleted.  Per kind, on a
copy whose newest checkpoint (step 4) is damaged, `checkpoint verify` and `train --dry-run` report
it and point at step 3 (in-process, cheap).  Then one real resume covers all three kinds at once:
step 4 flipped, step 3 truncated, step 2 uncommitted, so rerunning to step 5 must skip each of
them (a warning naming its step and its bad file), resume from step 1, restore the queue of step 1
only, relearn steps 2-4 exactly as the uninterrupted run did, and log every step once.  (One
start-up instead of one per kind: had any kind gone unnoticed, the run would have resumed from it.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.cli import main
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # worker_crash, shared with test_drills.py (tests/lanes.py)

COMMON = ["run.checkpoint_every=1", "run.keep_checkpoints=4", "data.eval_size=8", "run.eval_every=0"]
STEPS = ["step_000001", "step_000002", "step_000003", "step_000004"]


@pytest.fixture(scope="module")
def base(worker_crash):
    code, rec = worker_crash
    assert code == 0 and rec["recovered"], rec
    d = Path(rec["run_dir"])
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == STEPS
    return d


def _flip(ckpt):
    target = max((ckpt / "weights").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    return target.relative_to(ckpt).as_posix()


def _truncate(ckpt):
    target = ckpt / "queue_snapshot.db"
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    return "queue_snapshot.db"


def _uncommit(ckpt):
    (ckpt / "COMMITTED").unlink()
    return "COMMITTED"


DAMAGE = [_flip, _truncate, _uncommit]


@pytest.mark.parametrize("damage", DAMAGE, ids=["flipped", "truncated", "uncommitted"])
def test_verify_and_dry_run_skip_a_damaged_newest_checkpoint(base, tmp_path, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    good = run / "checkpoints" / "step_000003"
    bad_file = damage(run / "checkpoints" / "step_000004")

    assert main(["checkpoint", "verify", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["resume_from"] == str(good)
    assert report["checkpoints"][0]["status"] in ("corrupt", "uncommitted")
    assert bad_file in (report["checkpoints"][0]["problem"] or ""), report
    assert main(["train", "--dry-run", "--config", str(TINY), f"run.dir={run}", "run.steps=5", *COMMON]) == 0
    assert json.loads(capsys.readouterr().out)["resume_from"] == str(good)


def test_resume_skips_each_kind_of_damaged_checkpoint(base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    ckpts = run / "checkpoints"
    good = ckpts / "step_000001"
    bad = {step: damage(ckpts / f"step_{step:06d}") for step, damage in zip((4, 3, 2), DAMAGE)}
    assert main(["checkpoint", "verify", str(run), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["resume_from"] == str(good)

    proc = run_cli("train", "--config", str(TINY), f"run.dir={run}", "run.steps=5", *COMMON)
    log = proc.stderr
    assert last_json(proc.stdout)["steps"] == 5
    assert f"resumed from {good}" in log
    for step, bad_file in bad.items():  # each skip is a warning naming the step and its bad file
        assert any(f"skipping checkpoint step {step}:" in line and bad_file in line for line in log.splitlines()), \
            (step, bad_file, log[-4000:])
    restored = [line for line in log.splitlines() if "restored queue.db from" in line]
    assert restored and all(str(good) in line for line in restored), restored

    # Learning continues exactly as the uninterrupted run did, and each step is logged once.
    rows = [r for r in read_jsonl(run / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    ref = {r["step"]: r for r in read_jsonl(base / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    for r in rows[:4]:
        for key in ("learn/loss", "learn/grad_norm", "learn/reward_mean"):
            assert r[key] == ref[r["step"]][key], (r["step"], key)
    for step in (2, 3, 4):  # the damaged steps committed again
        assert (ckpts / f"step_{step:06d}" / "COMMITTED").is_file(), step
    assert main(["checkpoint", "verify", str(run)]) == 0
