"""The bad_checkpoint drill (issue #12): a damaged newest checkpoint is skipped, never loaded.

    python -m pytest tests/e2e/test_bad_checkpoint.py -q

One real tiny run of 4 steps leaves checkpoints at steps 2 and 4.  Each case copies it and
damages step 4: (a) bytes flipped in a weights file, (b) queue_snapshot.db truncated,
(c) COMMITTED deleted.  `checkpoint verify` and `train --dry-run` report it; rerunning to step 5
resumes from step 2, names the bad file, restores the queue of step 2 only, relearns steps 3-4
exactly as the uninterrupted run did, and metrics.jsonl holds every step once.
"""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl.cli import main
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMMON = ["run.checkpoint_every=2", "run.keep_checkpoints=3", "data.eval_size=8", "run.eval_every=0"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_ckpt") / "run"
    run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=4", *COMMON)
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
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


@pytest.mark.parametrize("damage", [_flip, _truncate, _uncommit], ids=["flipped", "truncated", "uncommitted"])
def test_resume_skips_damaged_newest_checkpoint(base, tmp_path, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    bad = run / "checkpoints" / "step_000004"
    good = run / "checkpoints" / "step_000002"
    bad_file = damage(bad)

    # In-process (cheap): `checkpoint verify` and the dry run's resume_from see the damage.
    assert main(["checkpoint", "verify", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["resume_from"] == str(good)
    assert report["checkpoints"][0]["status"] in ("corrupt", "uncommitted")
    assert bad_file in (report["checkpoints"][0]["problem"] or ""), report
    assert main(["train", "--dry-run", "--config", str(TINY), f"run.dir={run}", "run.steps=5", *COMMON]) == 0
    assert json.loads(capsys.readouterr().out)["resume_from"] == str(good)

    proc = run_cli("train", "--config", str(TINY), f"run.dir={run}", "run.steps=5", *COMMON)
    log = proc.stderr
    assert last_json(proc.stdout)["steps"] == 5
    assert f"resumed from {good}" in log
    assert bad_file in log and "step_000004" in log  # the warning names the bad file
    restored = [line for line in log.splitlines() if "restored queue.db from" in line]
    assert restored and all(str(good) in line for line in restored), restored

    # Learning continues exactly as the uninterrupted run did, and each step is logged once.
    rows = [r for r in read_jsonl(run / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    ref = {r["step"]: r for r in read_jsonl(base / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    for r in rows[:4]:
        for key in ("learn/loss", "learn/grad_norm", "learn/reward_mean"):
            assert r[key] == ref[r["step"]][key], (r["step"], key)
    assert (run / "checkpoints" / "step_000004" / "COMMITTED").is_file()  # step 4 committed again
    assert main(["checkpoint", "verify", str(run)]) == 0
