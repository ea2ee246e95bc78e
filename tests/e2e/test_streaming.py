"""Streaming rollouts with in-flight refit in a real training run, and resume (issue 27).

    python -m pytest tests/e2e/test_streaming.py -q

The tiny recipe in async mode with rollout.streaming on and long responses (200 tokens, EOS ignored), so
that generation outlasts a learner step and publications land while requests are in flight.  The engine
runs at most 8 sequences at once (rollout.engine_options.max_num_seqs=8): the groups admitted ahead queue in
it and generation never pauses, so a publication lands while sequences are mid-response.  (Without it, the
48 admitted sequences of equal length ran as one continuous batch and finished together, publications fell
between such waves, and whether any taken sequence spanned versions was left to timing.)  Run A
trains 3 steps and checkpoints with prompt groups in flight (the checkpoint does not drain the engine: it
saves the finished groups and names those still generating); B resumes the same run directory to step 5,
handing out the finished groups, with a checkpoint at every step; C resumes a copy from B's step 4 (written
with groups generating) and generates the named ones again.  What must hold:
- refits happen with requests kept (recompute mode), and no request is lost or trained twice;
- tokens of one sequence carry more than one version, each version backed by one publication digest,
  recorded as segments whose KV epoch is their own version (recompute);
- the learner checked every consumed token's digest (train/policy.py quarantine: a mismatch
  is kept out of the loss and counted);
- the audit (megatron_rl/audit/): audit.every=1 re-scores the taken sequences that span versions under
  their recorded versions with the learner's weight ring, within audit.tolerance; `megatron-rl audit RUN_DIR`
  re-scores them afterwards from what the run directory keeps (version 0 and the checkpoints' versions),
  and refuses a directory that is not a run;
- (issue 44, item 7, on the same runs) no process of run A -- driver, learner rank, rollout worker and its
  vLLM engine, coordinator, and the Ray cluster they run in -- listens beyond loopback (tests/listeners.py
  samples their sockets while it runs), and neither run prints a traceback on the console (the engine's
  shutdown at the end: rollout/engine_close.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sqlite3

import pytest

from megatron_rl.audit.config import AuditConfig
from megatron_rl.drill.streaming import STREAMING
from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import REPO, SHARED_RAY, TINY, last_json, read_jsonl, run_cli
from tests.listeners import RunWatch, is_loopback

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ALONE = pytest.mark.alone("asserts that refits landed while requests were in flight, which timing decides")
"""On the tests whose runs stream: the first (it sets up `run`, runs A and B, which the module's tests read) and
run C's; the others read files those runs left (replays and audits recompute on the learner: no timing)."""

AUDIT_TOLERANCE = AuditConfig().tolerance  # the default; the run measures ~4e-6 (printed by the audit tests)
STREAM = [*STREAMING, "run.eval_every=0", "run.checkpoint_every=3", "data.eval_size=8", "audit.every=1",
          "coordinator.keep_consumed=true"]
"""The streaming drills' recipe (megatron_rl/drill/streaming.py: async, 200-token responses, 8 sequences at once)."""
EVERY_STEP = ["run.checkpoint_every=1", "run.keep_checkpoints=3"]
"""Runs B and C: a checkpoint at every step, A's step 3 kept."""


SEEN: dict = {}
"""What the runs showed beside their results: run A's listeners, both runs' console output."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream") / "run"
    with RunWatch(also=lambda: SHARED_RAY.proc.pid if SHARED_RAY.proc is not None else None) as watch:
        # fresh: RunWatch finds the driver by its /proc/PID/environ, a forked one's is the warm server's
        pa = run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=3", *STREAM, fresh=True)
    pb = run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=5", *STREAM, *EVERY_STEP)
    SEEN.update(listeners=watch.seen, tagged=watch.processes, console=[pa.stdout + pa.stderr, pb.stdout + pb.stderr])
    return d, last_json(pa.stdout), last_json(pb.stdout)


@ALONE
def test_the_run_resumes_and_finishes(run):
    d, a, b = run
    assert (a["steps"], a["version"]) == (3, 3)
    assert (b["steps"], b["version"]) == (5, 5)
    consumed = [i for row in read_jsonl(d / "consumed.jsonl") for i in row["ids"]]
    assert len(consumed) == 5 * 4 * 4 and len(set(consumed)) == len(consumed)  # nothing trained twice


@ALONE
def test_a_checkpoint_with_groups_in_flight_resumes_without_loss_or_duplicate(run, tmp_path_factory):
    """B's step-4 checkpoint is written while prompt groups generate (the engine is not drained: it names
    them); run C resumes a copy of the run directory from it (step 5's checkpoint removed, as if the run died
    before it), generates those groups again and finishes step 5 on trajectories no earlier step took."""
    d, _, _ = run
    copy = tmp_path_factory.mktemp("stream_mid_flight") / "run"
    shutil.copytree(d, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000005")
    ckpt = copy / "checkpoints" / "step_000004"
    saved = json.loads((ckpt / "rollout_in_flight.json").read_text())
    assert saved and json.loads((ckpt / "COMMITTED").read_text())["extra"]["in_flight_groups"] == \
        [g["serial"] for g in saved], saved
    pc = run_cli("train", "--config", str(TINY), f"run.dir={copy}", "run.steps=5", *STREAM, *EVERY_STEP)
    c = last_json(pc.stdout)
    assert (c["steps"], c["version"]) == (5, 5), c
    assert f"generating again the {len(saved)} prompt groups" in pc.stdout + pc.stderr, pc.stderr[-3000:]
    final: dict[int, list] = {}
    for row in read_jsonl(copy / "consumed.jsonl"):  # a redone step's last attempt counts
        final[row["step"]] = row["ids"]
    ids = [i for step in sorted(final) for i in final[step]]
    assert sorted(final) == [1, 2, 3, 4, 5] and len(ids) == 5 * 4 * 4 and len(set(ids)) == len(ids)
    print(f"in flight at the step-4 checkpoint: {[g['serial'] for g in saved]}; C's step 5 took serials "
          f"{sorted({i.split('/')[0] for i in final[5]})}")


def test_no_process_of_the_run_listens_beyond_loopback(run):
    seen = SEEN["listeners"]
    print(f"run A: {len(SEEN['tagged'])} process(es) of its own, {len(seen)} listening socket(s) of them and of "
          f"the Ray cluster: {sorted({s.address for s in seen})}")
    names = " ".join(s.name for s in seen)
    assert "LearnerWorker" in names and "megatron_rl.cli" in names, sorted(map(str, seen))  # the watch saw the run
    wide = sorted(str(s) for s in seen if not is_loopback(s.address))
    assert not wide, "listeners of a single-node run beyond loopback (0.0.0.0 / :: is every interface):\n" + \
        "\n".join(wide)


def test_a_normal_run_prints_no_traceback(run):
    for console in SEEN["console"]:
        assert "Traceback" not in console and "EngineDeadError" not in console, console[-4000:]


def test_publications_landed_while_requests_were_in_flight(run):
    d, _, _ = run
    log = (d / "logs" / "ray_StreamRolloutWorker.log").read_text()
    kept = [int(n) for n in re.findall(r"refit to version \d+ \(recompute\): (\d+) request\(s\) kept", log)]
    assert len(kept) >= 5, log[-3000:]
    assert max(kept) > 0, f"no refit kept a request in flight: {kept}"
    metrics = read_jsonl(d / "metrics" / "metrics.jsonl")
    assert max(m.get("system/stream_multi_version_fraction", 0.0) for m in metrics) > 0
    # per step, the refits the engine committed and the requests they kept in flight (rollout/stream_actor.py)
    refits = [(m["system/engine_refits"], m["system/engine_refit_requests_kept"]) for m in metrics
              if "system/engine_refits" in m]
    assert len(refits) == 5 and sum(r for r, _ in refits) >= 4 and max(k for _, k in refits) > 0, refits
    # The engine's occupancy (running sequences / its 8) and idle fraction, per step (rollout/occupancy.py): near
    # full while groups queue in it; the first step after the resume takes the groups the checkpoint saved, and
    # its window can be all idle (measured: 0.97, 0.98, 0.98 | 0.0, 0.97).
    occupancy = [(m["system/engine_occupancy"], m["system/engine_idle_fraction"]) for m in metrics
                 if "system/engine_occupancy" in m]
    print(f"engine occupancy, idle fraction per step: {[(round(o, 2), round(i, 2)) for o, i in occupancy]}")
    assert len(occupancy) == 5 and all(0 <= o <= 1 and 0 <= i <= 1 for o, i in occupancy), occupancy
    assert sum(o > 0.5 for o, _ in occupancy[:3]) >= 2, occupancy  # run A: the engine ran near-full batches


def test_every_token_names_the_publication_that_sampled_it(run):
    d, _, _ = run
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    assert trajs
    digests: dict[str, set] = {}
    for t in trajs:
        versions = {str(v) for v in t.policy_versions.tolist()}
        assert versions == set(t.weights), (t.id, versions, t.weights)
        for v, digest in t.weights.items():
            digests.setdefault(v, set()).add(digest)
    assert all(len(found) == 1 for found in digests.values()), digests  # one publication per version
    assert all(found != {"disk"} for v, found in digests.items() if v != "0"), digests
    assert any(len(set(t.policy_versions.tolist())) > 1 for t in trajs), "no sequence spans two versions"
    # Segments: one per version switch; in recompute mode every kept request's KV was recomputed.
    for t in trajs:
        assert len(t.segments) == 1 + int((t.policy_versions[1:] != t.policy_versions[:-1]).sum()), t.segments
        assert (t.kv_versions == t.policy_versions).all(), t.segments


def test_the_audit_inside_training_rescored_spanning_sequences(run):
    d, _, _ = run
    audits = [m for m in read_jsonl(d / "metrics" / "metrics.jsonl") if m.get("numerics/audit_segments")]
    assert audits, "no step audited a sequence spanning versions"
    worst = max(m["numerics/audit_worst_abs_delta"] for m in audits)
    labels = {k for m in audits for k in m if k.startswith("numerics/audit_max_abs_delta/")}
    print(f"in-training audit: {len(audits)} step(s), worst max |Δ| {worst:.3g}, per label "
          f"{ {k.rpartition('/')[2]: max(m[k] for m in audits if k in m) for k in labels} }")
    assert worst < AUDIT_TOLERANCE and not any(m["numerics/audit_over_tolerance"] for m in audits)
    assert any("numerics/audit_max_abs_delta/recompute" in m for m in audits)  # segments begun by in-flight refits


def test_the_audit_command_rescores_what_the_run_directory_keeps(run):
    d, _, _ = run
    out = last_json(run_cli("audit", str(d), "--sequences", "8").stdout)  # the run's audit.tolerance
    print(f"megatron-rl audit: {out['audited_sequences']} sequence(s), weights of versions {out['weights_versions']}, "
          f"per label { {k: v['max_abs_delta'] for k, v in out['by_mode'].items()} }")
    assert out["weights_versions"] == [0, 3, 4, 5] and out["audited_sequences"] >= 1
    assert out["numerics/audit_segments"] >= 1 and not out["failures"]
    assert out["numerics/audit_worst_abs_delta"] < AUDIT_TOLERANCE
    audited = {(s["version"], s["max_abs_delta"] is not None) for s in out["segments"]}
    assert all(v in (0, 3, 5) for v, done in audited if done)  # only versions whose weights were kept


def test_the_audit_command_refuses_a_directory_that_is_not_a_run(tmp_path):
    proc = run_cli("audit", str(REPO / "configs"), check=False)
    assert proc.returncode == 2 and "not a training run directory" in proc.stderr, proc.stderr[-2000:]


def test_the_audit_command_names_a_forged_segment(run, tmp_path):
    """A copy of the run whose log holds one trajectory with a behaviour logprob moved by 0.01 nat in a segment
    of a kept version (as a stale KV or a wrong sampler would): the audit exits 89 naming it.  (The checkpoints'
    copies of the log keep the genuine bytes; the audit takes the run's log first.)"""
    d, _, _ = run
    copy = tmp_path / "run"
    shutil.copytree(d, copy, ignore=shutil.ignore_patterns("logs", "export"))
    with sqlite3.connect(copy / "queue.db") as db:
        rows = [(seq, Trajectory.from_bytes(blob)) for seq, blob in db.execute("SELECT seq, payload FROM traj")]
        seq, traj = next((s, t) for s, t in rows if len(t.segments) > 1 and any(g[2] in (3, 5) for g in t.segments))
        index, (start, *_rest) = next((i, g) for i, g in enumerate(traj.segments) if g[2] in (3, 5))
        lps = traj.behavior_logprobs.copy()
        lps[start] -= 0.01
        forged = dataclasses.replace(traj, behavior_logprobs=lps)
        forged = dataclasses.replace(forged, checksum=forged.compute_checksum())
        db.execute("UPDATE traj SET payload = ? WHERE seq = ?", (forged.to_bytes(), seq))
    proc = run_cli("audit", str(copy), "--sequences", "1000", f"--tolerance={AUDIT_TOLERANCE}", check=False)
    assert proc.returncode == 89, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"sequence {traj.id} segment {index} " in proc.stderr, proc.stderr[-2000:]


def test_replay_of_the_async_streaming_resumed_run_is_bit_identical(run):
    d, _, _ = run
    report = last_json(run_cli("replay", str(d), "--json").stdout)
    assert report["identical"] is True and report["first_difference"] is None, report
    assert [r["step"] for r in report["steps"]] == [1, 2, 3, 4, 5]
    assert report["checkpoints"] == {"step_000003": True, "step_000004": True, "step_000005": True}
    with sqlite3.connect(d / "queue.db") as db:
        n, size = db.execute("SELECT count(*), sum(length(payload)) FROM traj").fetchone()
        kept_n, kept_size = db.execute("SELECT count(*), coalesce(sum(length(payload)), 0) FROM kept").fetchone()
    print(f"log: {n} trajectories in traj ({size} bytes), {kept_n} kept by compaction ({kept_size} bytes): "
          f"{(size + kept_size) / max(n + kept_n, 1):.0f} bytes per trajectory of up to 200 response tokens")


def test_a_replay_from_a_checkpoint_is_bit_identical_and_a_counterfactual_from_it_differs_at_once(run):
    """`replay --from-step K` (issue 47 item 4's bisecting tool): from the resumed run's step-3 checkpoint, the
    learner's weights, optimizer, β and RNG restored, steps 4-5 replay bit for bit; the same with another
    learning rate differs at step 4, the first step it runs."""
    d, _, _ = run
    report = last_json(run_cli("replay", str(d), "--from-step", "3", "--json").stdout)
    assert report["identical"] is True and report["from_step"] == 3, report
    assert [r["step"] for r in report["steps"]] == [4, 5]
    assert report["checkpoints"] == {"step_000004": True, "step_000005": True}
    proc = run_cli("replay", str(d), "--from-step", "3", "--to-step", "4", "--set", "learner.lr=0.5", "--json",
                   check=False)
    changed = last_json(proc.stdout)
    assert proc.returncode == 1 and changed["first_difference"] == 4 and not changed["identical"], changed
    # the checkpoint's optimizer state held its own max_lr, which Megatron's scheduler read first: this replay
    # (and any resume with another learner.lr) went on at the recorded lr, identical (learner/optimizer.py)
    assert changed["steps"][0]["lr"] == 0.5 and "lr" in changed["steps"][0]["differs"], changed["steps"][0]
    assert changed["checkpoints"] == {"step_000004": False}  # the update used it


def test_a_replay_with_another_learning_rate_differs_at_step_1(run):
    d, _, _ = run
    proc = run_cli("replay", str(d), "--to-step", "1", "--set", "learner.lr=0.5", "--json", check=False)
    report = last_json(proc.stdout)
    assert proc.returncode == 1 and report["first_difference"] == 1 and not report["identical"], report
    assert "lr" in report["steps"][0]["differs"], report["steps"][0]
