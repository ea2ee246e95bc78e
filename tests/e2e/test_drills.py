"""Fault drills (issue #12) through the real `megatron-rl drill` CLI on the tiny recipe.

    python -m pytest tests/e2e/test_drills.py -q

Each drill runs once (2-5 steps, no dev evals): worker_crash (2 training attempts; a checkpoint at every
step, its run also the base of tests/e2e/test_bad_checkpoint.py: tests/e2e/conftest.py), oom (1), oom_twice
(2: the stop, then the rerun with a smaller micro-batch; these three run two at a time, conftest.py
_sync_drills), the shadow-forward check (1 attempt on a copy of the oom run, refused at resume).
verifier_timeout, bad_refit and coordinator_stop share one run (`megatron-rl drill together`: each judged on the
shared run by its own rules, timed from its own injection).  None of these reads timing, so they may run beside
other modules' runs; the drills whose faults are armed while requests are in flight (engine crashes,
partition, stale KV, an engine dying in a refit) run alone, in tests/e2e/test_drills_in_flight.py.  The
bad_checkpoint drill's fallback is the resume path that tests/e2e/test_bad_checkpoint.py drives for each kind
of damage (`megatron-rl drill bad_checkpoint` wraps it).  Every record must show what the protocol promises:
recovered (or the documented clean stop), 0 trajectories lost, 0 duplicated, continuous versions.  The oom run
is also compared with the worker_crash run, whose steps 1-4 are those of an uninterrupted run (resume is
exact): same losses before the fault, the same up to float summation order at and after it (no partial or
doubled optimizer update).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.drill.harness import DEFAULT_OVERRIDES
from tests.e2e.conftest import TINY, drills_together, protocol_kept, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
@pytest.fixture(scope="module")
def one_run_drills(tmp_path_factory):
    """verifier_timeout, bad_refit and coordinator_stop in one run of 3 steps, the faults at step 1."""
    return drills_together(tmp_path_factory, ("verifier_timeout", "bad_refit", "coordinator_stop"),
                     "--at-step", "1", "--steps", "3")


def _losses(run_dir):
    return {r["step"]: r for r in read_jsonl(Path(run_dir) / "metrics" / "metrics.jsonl") if "learn/loss" in r}


def test_worker_crash_exits_75_and_resumes(worker_crash):  # the fixture: tests/e2e/conftest.py
    code, rec = worker_crash
    assert code == 0 and rec["recovered"], rec
    assert rec["first_exit"] == 75 and rec["fail_fast_s"] < 60, rec
    assert "learner rank 0 died" in rec["evidence"], rec
    assert rec["checkpoint_versions"] == {"1": 1, "2": 2, "3": 3, "4": 4}, rec  # run.checkpoint_every=1
    protocol_kept(rec, redone=0)  # step 3 never finished before the kill: nothing learned twice


def test_oom_retries_at_half_micro_batch(oom, worker_crash):  # both fixtures: tests/e2e/conftest.py
    code, rec = oom
    assert code == 0 and rec["recovered"], rec
    assert "micro_batch_size 64" in rec["evidence"], rec
    protocol_kept(rec, redone=0)  # the retry happens inside the step
    # worker_crash's steps 1-4 are those of an uninterrupted run (resume is exact)
    got, ref = _losses(rec["run_dir"]), _losses(worker_crash[1]["run_dir"])
    assert got[3]["numerics/oom_retries"] == 1.0 and got[2]["numerics/oom_retries"] == 0.0
    for step in (1, 2):  # before the fault: bit-identical
        assert got[step]["learn/loss"] == ref[step]["learn/loss"]
    for step in (3, 4):  # the retried step and the one after it: the same batch and weights
        for key in ("learn/loss", "learn/grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_oom_twice_stops_cleanly_then_resumes_smaller(oom_twice):  # tests/e2e/conftest.py, beside worker_crash
    code, rec = oom_twice
    assert code == 0 and rec["clean_stop"] and rec["recovered"], rec
    assert [a["exit"] for a in rec["attempts"]] == [87, 0], rec
    assert "micro_batch_size 64 and again at 32" in rec["evidence"], rec
    assert "step_000002" in rec["action"], rec  # the rerun resumed from the checkpoint before the stop
    protocol_kept(rec, redone=0)  # the failed step applied nothing and logged nothing


def test_verifier_timeout_is_counted_and_excluded(one_run_drills):
    code, records = one_run_drills
    rec = records["verifier_timeout"]
    assert code == 0 and rec["recovered"], rec
    assert rec["injected_at"]["share_of_grading_calls"] == 0.05, rec
    assert 1 <= rec["timeouts_counted"] <= rec["injected_at"]["hung_calls"], rec
    assert rec["verifier_error_rate"] > 0, rec
    assert rec["effective_tps"] < rec["raw_tps"], rec
    protocol_kept(rec, redone=0)


def _alter_embedding(ckpt):
    """Scale the word embedding's stored values (the test double for tampered weights) and rewrite the
    COMMITTED manifest so every sha256 matches again."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_rl.durable_files import file_sha256

    weights = ckpt / "weights"
    meta = FileSystemReader(str(weights)).read_metadata()
    # The model's copy and the distributed optimizer's fp32 copy (which the model is refilled from).
    infos = [v for i, v in meta.storage_data.items()
             if i.fqn in ("embedding.word_embeddings.weight", "optimizer.state.param.embedding.word_embeddings.weight")]
    assert len(infos) == 2, [i.fqn for i in meta.storage_data]
    manifest = json.loads((ckpt / "COMMITTED").read_text())
    for info in infos:
        target = weights / info.relative_path
        data = target.read_bytes()
        tensor = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]), weights_only=True)
        buf = io.BytesIO()
        torch.save(tensor * 3.0, buf)
        assert len(buf.getvalue()) == info.length
        target.write_bytes(data[:info.offset] + buf.getvalue() + data[info.offset + info.length:])
        manifest["files"][target.relative_to(ckpt).as_posix()] = {"sha256": file_sha256(target),
                                                                  "bytes": target.stat().st_size}
    (ckpt / "COMMITTED").write_text(json.dumps(manifest))


def test_shadow_forward_refuses_altered_weights_with_matching_manifest(oom, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(oom[1]["run_dir"], run, symlinks=True)
    ckpt = run / "checkpoints" / "step_000004"
    _alter_embedding(ckpt)
    assert main(["checkpoint", "verify", str(run)]) == 0  # every sha256 matches: bytes look intact
    proc = run_cli("train", "--config", str(TINY), f"run.dir={run}", "run.steps=5", *DEFAULT_OVERRIDES, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "shadow forward" in proc.stderr and "step_000004" in proc.stderr, proc.stderr[-3000:]
    assert "refusing to continue" in proc.stderr
    assert not (run / "checkpoints" / "step_000005").exists()


def test_refit_check_catches_permuted_load(one_run_drills):
    code, records = one_run_drills
    rec = records["bad_refit"]
    assert code == 0 and rec["recovered"], rec
    assert rec["detected_by"] and "refit check: version 2 loaded" in rec["evidence"], rec
    assert rec["action"].startswith("group rolled back to version 1"), rec
    protocol_kept(rec, redone=0)


def test_coordinator_stop_waits_and_loses_nothing(one_run_drills):
    # The coordinator actor SIGSTOPped 10 s at the first put of round 1, before that put is applied.
    code, records = one_run_drills
    rec = records["coordinator_stop"]
    assert code == 0 and rec["recovered"], rec
    assert [a["exit"] for a in rec["attempts"]] == [0], rec
    assert rec["injected_at"]["trajectories_in_the_put"] == 64, rec  # a whole round's put was held
    assert rec["waited_s"] >= 9.0, rec  # the step really waited on the stopped coordinator
    protocol_kept(rec, redone=0)
