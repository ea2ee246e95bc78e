"""The main job end to end on CPU: reward rises, panels reach TensorBoard, a stop condition ends a run,
resume is exact.

    python -m pytest tests/e2e/test_train.py -q

Three real training runs (and one reconcile) of the tiny recipe (Megatron learner over gloo, vLLM CPU engine,
Ray coordinator with its WAL, verifier pool): A runs 4 steps uninterrupted (colocated
placement); B, with the disaggregated placement, is ended at step 1 by a stop condition
(stop.d_lag_p95_max=0: any learner/behaviour lag at all, and fp32 CPU gives ~1e-6), which must
checkpoint step 1, exit 85 (lag_p95) naming the condition in the log and in its final JSON line, and
leave a run `megatron-rl doctor` points at the lag leaf of the runbook; then B resumes from that
checkpoint without the condition to step 4.  Placement moves actors, not numbers: A and B must
agree exactly.  Independent runs start two at a time (`_runs`): A beside B's stopped attempt, then B's resume
beside the reconcile run; each is read and checked by its own fixture.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.reporting.stop import EXIT_CODES
from tests.e2e.conftest import TINY, last_json, read_jsonl, run_cli, start_cli, wanted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMMON = ["run.eval_every=2", "run.checkpoint_every=2", "run.keep_checkpoints=3"]
CONSOLE: dict = {}  # run directory -> the lines its `megatron-rl train` printed (stdout + stderr)


SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}  # test_reconcile_at_step_zero_with_temperature_top_p_top_k


@pytest.fixture(scope="module")
def _runs(tmp_path_factory):
    """The module's CLI runs, each started once, by whichever fixture needs it first (`_start`); at the end,
    one that no fixture waited for (its reader errored) is ended."""
    runs = SimpleNamespace(a=tmp_path_factory.mktemp("run_a"), b=tmp_path_factory.mktemp("run_b"),
                           rec=tmp_path_factory.mktemp("reconcile") / "rec", started={})
    yield runs
    for started in runs.started.values():
        started.kill()


def _b_args(runs) -> tuple:
    return ("train", "--config", str(TINY), f"run.dir={runs.b}", "run.steps=4", "run.placement=disaggregated",
            *COMMON)


def _start(runs, key: str):
    if key not in runs.started:
        args = {"a": ("train", "--config", str(TINY), f"run.dir={runs.a}", "run.steps=4", *COMMON),
                "b_stopped": (*_b_args(runs), "stop.d_lag_p95_max=0"),
                "b_resumed": _b_args(runs),
                "reconcile": ("reconcile", "--config", str(TINY), f"run.dir={runs.rec}",
                              *(f"rollout.{k}={v}" for k, v in SAMPLING.items()))}[key]
        # A, as a user's run: fresh (test_console_is_quiet... reads all it printed, imports' output too:
        # tests/e2e/warm_cli.py) and on a Ray of its own, whose log monitor tails only this run's workers (the
        # suite's, after some hundred workers, lost all of an actor's lines to A's driver once: session 38)
        runs.started[key] = start_cli(*args, check=key != "b_stopped", fresh=key == "a", own_ray=key == "a")
    return runs.started[key]


@pytest.fixture(scope="module")
def run_a(_runs, request):
    started = _start(_runs, "a")
    if wanted(request, "run_b"):
        _start(_runs, "b_stopped")  # beside A: independent, and no test of either reads timing
    proc = started.result()
    d = _runs.a
    CONSOLE[d] = proc.stdout.splitlines() + proc.stderr.splitlines()
    return d, last_json(proc.stdout)


def test_console_is_quiet_and_engine_logs_go_to_the_run_dir(run_a):
    """At most 40 console lines, one progress line per step; vLLM/Megatron/Ray logs in RUN_DIR/logs/."""
    d, _ = run_a
    console = CONSOLE[d]
    assert len(console) <= 40, "\n".join(console)
    steps = [line.split()[1] for line in console if line.startswith("step ")]
    assert steps == ["1/4", "2/4", "3/4", "4/4"], console
    assert not [line for line in console if "vLLM" in line or "(RolloutWorker" in line or " WARNING ray" in line]
    logs = d / "logs"
    rollout = (logs / "ray_RolloutWorker.log").read_text()
    # vLLM's own lines of this run's engine, found by the process the driver logged it in (driver.log: "rollout
    # engines up: group 0 in process P on HOST").  Not given lines: in a busy shared Ray cluster its log pipeline
    # has dropped batches of an engine's lines on their way to the driver (CI: five start-up lines once, with run
    # B beside A; another time each batch with a line naming the model) -- Ray's forwarding is best effort.
    driver = (logs / "driver.log").read_text()
    pids = re.findall(r"rollout engines up: group 0 in process (\d+) on ", driver)
    assert len(pids) == 1, driver[-3000:]
    pid = pids[0]
    engine = re.findall(rf"^\(pid={pid}, [^)]*\) \(MainProcess pid={pid}\) (?:INFO|WARNING) .* \[\w+\.py:\d+\] ", rollout,
                        flags=re.MULTILINE)
    assert len(engine) >= 10, rollout[-3000:]
    assert (logs / "ray_LearnerWorker.log").stat().st_size > 0
    assert "megatron_rl.progress: step 4/4" in (logs / "driver.log").read_text()


def test_report_draws_the_runs_plots(run_a):
    from megatron_rl.panels import CHARTS
    from megatron_rl.report import write_report

    d, _ = run_a
    result = write_report(d)
    drawn = {p.rsplit("/", 1)[-1] for p in result["plots"]}
    # Every chart of the report has data in a real run (the queue's drop counters included); a feature's
    # charts are drawn for runs that use it: run A has a KL penalty (the KL coefficient chart), and no
    # multi-turn episodes (env/: tests/e2e/test_episodes.py), LoRA or streaming.
    wanted = {f"{c.slug}.png" for c in CHARTS if c.in_report and (not c.feature or c.feature == "learn/kl_coef")}
    assert drawn == wanted, result["missing"]
    assert "kl_coefficient.png" in drawn


def test_reward_rises_on_held_out_split(run_a):
    _, summary = run_a
    assert summary["steps"] == 4 and summary["version"] == 4
    # The hidden test split, greedy decoding, before training and after 4 GRPO steps.
    assert summary["final_test_reward"] >= summary["initial_test_reward"] + 0.2, summary
    assert 0.0 <= summary["initial_test_correctness"] <= 1.0 and 0.0 <= summary["final_test_correctness"] <= 1.0


def test_every_panel_reaches_tensorboard(run_a):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, _ = run_a
    acc = EventAccumulator(str(d / "metrics" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "learn/reward_mean", "learn/reward_correctness", "learn/reward_format", "learn/kl_ref_k2_grad_theta_ref",
        "learn/kl_ref_estimate",
        "learn/entropy_estimate", "learn/response_length", "learn/clip_fraction", "learn/grad_norm",
        "numerics/nonfinite_loss", "numerics/nonfinite_grad_norm", "numerics/min_behavior_logprob",
        "system/generated_tokens_per_s", "system/learned_tokens_per_s", "system/esr",
        "system/effective_tokens_per_s", "system/time_learn_s", "system/driver_max_rss_gib",
        "latency/rollout_round_s/p50", "latency/verifier_batch_s/p99", "latency/verifier_timeout",
        "queue/depth", "queue/age_s_p95", "queue/taken_dv/p95", "learn/d_lag", "learn/d_lag/p50", "learn/d_lag/p99",
        "eval/test_reward", "eval/dev_reward",
    }
    missing = sorted(expected - tags)
    assert not missing, f"missing TensorBoard tags: {missing}"
    steps = [e.step for e in acc.Scalars("learn/reward_mean")]
    assert steps == [1, 2, 3, 4]
    # On-policy fp32: the learner scores the sampled tokens as vLLM did.  Measured at every step
    # (a missing lag is absent, never a 0 that passes this bound).
    lag = acc.Scalars("learn/d_lag/p99")
    assert [e.step for e in lag] == [1, 2, 3, 4], [e.step for e in lag]
    assert max(e.value for e in lag) < 1e-4


def _weights(ckpt_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir / "weights"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


REFERENCE = Path(__file__).parent / "data" / "run_a_reference.json"
"""One recording per machine kind (run_a_reference*.json), each from a run of the commit before the redesign
(a55d003^): AVX2, _avx512 (both recorded before the vendor was part of a machine's description) and
_avx512_amd (an AuthenticAMD AVX512 machine, whose last bits differ from the _avx512 one's)."""


def test_run_a_is_bit_identical_to_the_run_recorded_before_the_redesign(run_a):
    """The middle-layer redesign (issue 26: transports, the learner rank by composition) changed no
    number.  REFERENCE holds run A's loss and grad norm at every step and a digest of every checkpoint's
    weights, recorded with the code before it (`python -m benchmarks.differential_run DIR --record`).
    Bit-identity holds for one torch build and CPU kernel set: on another, the recording is not
    comparable and the test says so instead of passing."""
    from benchmarks.differential_run import compare, figures, machine, recording_for

    recorded = [json.loads(p.read_text()) for p in sorted(REFERENCE.parent.glob(REFERENCE.stem + "*.json"))]
    want = recording_for(recorded, machine())
    if want is None:
        pytest.skip(f"references recorded on {[r['machine'] for r in recorded]}, this machine is {machine()}: "
                    f"record one here with the code before the redesign")
    assert compare(want, figures(run_a[0])) == []


def test_every_queued_token_names_the_weights_that_sampled_it(run_a):
    """Per-token provenance (issue 27): vLLM labels each token with "<version>:<digest>"; every
    trajectory in run A's queue carries, for each of its versions, the digest of the publication that
    sampled it; one digest per version across the run; version 0 is the checkpoint on disk."""
    import sqlite3

    from megatron_rl.trajectory import Trajectory

    with sqlite3.connect(run_a[0] / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    assert trajs
    seen: dict[str, set] = {}
    for t in trajs:
        assert set(t.weights) == {str(v) for v in t.policy_versions.tolist()}, t.id
        for version, digest in t.weights.items():
            seen.setdefault(version, set()).add(digest)
    assert all(len(d) == 1 for d in seen.values()), seen
    assert seen.pop("0", {"disk"}) == {"disk"} and seen  # later versions: publications, not the disk
    assert all(len(next(iter(d))) == 16 for d in seen.values()), seen


@pytest.fixture(scope="module")
def run_b(_runs, request):
    """B: stopped at step 1 by stop.d_lag_p95_max=0 (what it left then, and doctor on it), then resumed to 4."""
    b = _runs.b
    stopped = _start(_runs, "b_stopped").result()
    ckpts = sorted((b / "checkpoints").iterdir()) if (b / "checkpoints").is_dir() else []
    at_stop = SimpleNamespace(
        proc=stopped, ckpts=[c.name for c in ckpts], committed=[(c / "COMMITTED").is_file() for c in ckpts],
        steps=[r["step"] for r in read_jsonl(b / "metrics" / "metrics.jsonl") if "learn/loss" in r],
        condition=(json.loads((b / "stop_condition.json").read_text()) if (b / "stop_condition.json").is_file()
                   else None),
        doctor=run_cli("doctor", str(b), "--json", check=False))
    resumed = None
    if stopped.returncode == EXIT_CODES["lag_p95"]:
        resuming = _start(_runs, "b_resumed")
        if wanted(request, "reconciled"):
            _start(_runs, "reconcile")  # beside B's resume: independent, and no test of either reads timing
        resumed = resuming.result()
    return b, at_stop, resumed


def test_lag_p95_stop_checkpoints_and_exits_with_its_code(run_b):
    _, at_stop, _ = run_b
    proc = at_stop.proc
    assert proc.returncode == EXIT_CODES["lag_p95"] == 85, proc.stderr[-4000:]
    final = last_json(proc.stdout)
    assert final["stopped"] == "lag_p95" and final["exit_code"] == 85 and final["checkpointed"] is True
    assert final["step"] == 1 and final["metric"] == "learn/d_lag/p95" and final["value"] > 0
    assert "stop condition lag_p95 at step 1" in proc.stderr
    assert at_stop.ckpts == ["step_000001"] and at_stop.committed == [True]  # checkpoint_every=2: the stop's own
    assert at_stop.steps == [1]  # stopped: no step 2
    assert at_stop.doctor.returncode == 1
    leaves = {f["leaf"] for f in json.loads(at_stop.doctor.stdout)["findings"]}
    assert "lag-rising" in leaves and "publication-refused" not in leaves, at_stop.doctor.stdout
    assert at_stop.condition["stopped"] == "lag_p95"


def test_resume_is_exact(run_a, run_b):
    a, _ = run_a
    b, _, proc = run_b
    assert proc is not None, "run B did not stop at step 1 (test_lag_p95_stop_checkpoints_and_exits_with_its_code)"
    assert "resumed from" in proc.stderr and "step_000001" in proc.stderr  # the stop's checkpoint
    # The refit check of the resumed version runs on the sampled rows the checkpoint kept, not on random tokens.
    manifest = json.loads((b / "checkpoints" / "step_000001" / "COMMITTED").read_text())
    rows = manifest["extra"]["refit_probe_rows"]
    assert rows and all(len(r) == len(rows[0]) > 1 for r in rows), rows
    assert "uniformly random tokens" not in proc.stderr
    rows_a = {r["step"]: r for r in read_jsonl(a / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    rows_b = {r["step"]: r for r in read_jsonl(b / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    assert sorted(rows_b) == [1, 2, 3, 4]  # steps continue after the resume; nothing recomputed from 1
    for step in (1, 2, 3, 4):
        for key in ("learn/loss", "learn/grad_norm", "learn/reward_mean"):
            assert rows_a[step][key] == rows_b[step][key], (step, key)
    wa, wb = _weights(a / "checkpoints" / "step_000004"), _weights(b / "checkpoints" / "step_000004")
    assert wa.keys() == wb.keys() and len(wa) > 0
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def reconciled(_runs):
    """`megatron-rl reconcile` at step 0 with SAMPLING (started beside B's resume when both are wanted), ended;
    the test reads and checks its result."""
    started = _start(_runs, "reconcile")
    started.finish()
    return started


def test_reconcile_at_step_zero_with_temperature_top_p_top_k(reconciled):
    """The learner scores vLLM's processed distribution: temperature 0.7, top_p 0.9, top_k 20 in one run.

    One reconcile start-up for both claims: the default sampling's agreement is also measured at every
    step of run_a (learn/d_lag/p99 < 1e-4 in test_every_panel_reaches_tensorboard)."""
    sampling = SAMPLING
    proc = reconciled.result()
    summary = last_json(proc.stdout)
    assert summary["step"] == 0 and summary["tokens"] > 0 and summary["sampling"] == sampling
    # Before the learner applied the sampling settings this was 0.68 (max 1.16).
    assert summary["behavior_vs_current_mean_abs"] < 1e-4, summary
    assert summary["behavior_vs_current_max_abs"] <= 1e-3, summary
    # Checked over every sequence of the round, and the round had something to check.
    assert summary["nonzero_variance_groups"] >= 1, summary
    assert summary["grad_sign_checked_sequences"] >= 2 and summary["grad_sign_disagreeing_rows"] == [], summary
    assert summary["grad_sign_agrees_with_advantage"] is True
    assert "behavior" in proc.stdout and "reference" in proc.stdout  # the table was printed
