"""Exact resume with rollout ahead of the learner (issue #15), and a refused layout change.

    python -m pytest tests/e2e/test_resume_one_step_off.py -q

Real runs of the tiny recipe in one_step_off mode (Megatron learner, vLLM CPU engine, Ray
coordinator with its WAL): A runs 4 steps uninterrupted; B runs 2 steps, stops, and resumes
from its checkpoint to step 4.  When B checkpoints, round 2 was already sampled with version 1;
it must be replayed from the checkpoint, not regenerated with version 2, so A and B agree
bit for bit at steps 3-4.  Then resuming B with two learner data-parallel ranks is refused up
front, before Ray or any model starts.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from tests.e2e.conftest import TINY, read_jsonl, run_cli, start_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ONE_STEP_OFF = ["run.mode=one_step_off", "run.checkpoint_every=2",
                "run.keep_checkpoints=3", "run.eval_every=0", "data.eval_size=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a = tmp_path_factory.mktemp("one_step_off_a")
    b = tmp_path_factory.mktemp("one_step_off_b")
    # A beside B's first attempt (independent runs; no test here reads their timing), then B's resume.
    started = [start_cli("train", "--config", str(TINY), f"run.dir={a}", "run.steps=4", *ONE_STEP_OFF)]
    try:
        run_cli("train", "--config", str(TINY), f"run.dir={b}", "run.steps=2", *ONE_STEP_OFF)
        started.append(start_cli("train", "--config", str(TINY), f"run.dir={b}", "run.steps=4", *ONE_STEP_OFF))
        started[0].result()
        resumed = started[1].result()
    finally:
        for s in started:
            s.kill()  # after a failure only: a finished run is left as it is
    return a, b, resumed


def _weights(ckpt_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir / "weights"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_one_step_off_resume_is_exact(runs):
    a, b, resumed = runs
    assert "resumed from" in resumed.stderr
    rows_a = {r["step"]: r for r in read_jsonl(a / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    rows_b = {r["step"]: r for r in read_jsonl(b / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    assert sorted(rows_a) == sorted(rows_b) == [1, 2, 3, 4]
    for rows in (rows_a, rows_b):  # one_step_off: at most one version stale, and really off-policy after step 1
        assert all(rows[s]["queue/taken_dv/p99"] <= 1 for s in rows), {s: rows[s]["queue/taken_dv/p99"] for s in rows}
        assert rows[2]["queue/taken_dv/p50"] == 1
    for step in (3, 4):
        for key in ("learn/loss", "learn/grad_norm", "learn/reward_mean", "queue/taken_dv/p50"):
            assert rows_a[step][key] == rows_b[step][key], (step, key, rows_a[step][key], rows_b[step][key])
    wa, wb = _weights(a / "checkpoints" / "step_000004"), _weights(b / "checkpoints" / "step_000004")
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert "replaying rollout rounds [2]" in resumed.stderr  # round 2 came from the checkpoint


def test_resume_at_another_data_parallel_size_is_refused_up_front(runs, tmp_path):
    _, b, _ = runs
    c = tmp_path / "run_c"
    shutil.copytree(b, c)
    t0 = time.monotonic()
    proc = run_cli("train", "--config", str(TINY), f"run.dir={c}", "run.steps=6",
                   "learner.data_parallel_size=2", "learner.micro_batch_size=32", *ONE_STEP_OFF, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot resume" in proc.stderr and "(1, 1, 1), this run has (1, 1, 2)" in proc.stderr, proc.stderr[-3000:]
    assert "Ray" not in proc.stderr and time.monotonic() - t0 < 60  # refused before anything started
    assert (c / "queue.db").exists() or not (b / "queue.db").exists()  # the live queue was left alone
