"""Two runs in one shared Ray cluster (the experiment runner's) stay apart; a token budget ends a run.

    python -m pytest tests/e2e/test_shared_ray.py -q

The test process starts the cluster the way `megatron-rl experiment` does
(experiment.shared_ray_cluster) and launches two tiny GRPO runs at the same time against it
(run.use_existing_ray, vLLM in the rollout actor): A samples at temperature 1.0 under a
generated-token budget, B at 0.7 for 6 steps in async mode with backpressure on staleness.  Each
run's queue (its WAL in its own run dir) must hold only its own trajectories, both runs must be jobs
of the one cluster, and A must stop on its budget: exit 0, checkpointed, its final test eval done,
"stopped" in its final JSON line.  A is then rerun: it resumes with its budget spent, runs no step,
and its final test eval is in metrics.jsonl and TensorBoard once.

Backpressure (B): the learner's D_lag P95 report throttles admission, so the producer stops sampling
ahead and later rounds are fresh.  coordinator.max_staleness=2 lets the producer sample rounds 0-2
with version 0 before the first update.  coordinator.backpressure_d_lag_p95=0 puts backpressure on
from the first learner report (fp32 CPU D_lag is ~1e-6 > 0), so admission uses eta 0: round r can
only be admitted once accepted + running + B <= (v + 1) B, i.e. at version v >= r, and every round
from 3 on is learned with Δv = 0, whatever the timing.  Without the throttle the producer may sample
round 3 with version 1 (Δv 2).  (B shares A's start-up instead of a run of its own.)  B keeps what it
consumed (coordinator.keep_consumed), and `megatron-rl replay` re-runs its learner side bit for bit; so
does A's (sync), stopped by its budget and resumed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_rl.experiment.runner import shared_ray_cluster
from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import REPO, TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.own_ray("what it tests is the experiment runner's own shared cluster (shared_ray_cluster)")]

COMMON = ["run.eval_every=0", "data.eval_size=8", "run.use_existing_ray=true", "rollout.engine_in_process=true"]
BACKPRESSURE = ["run.mode=async", "coordinator.max_staleness=2", "coordinator.max_version_lag=2",
                "coordinator.backpressure_d_lag_p95=0", "coordinator.keep_consumed=true"]  # (kept: replay reads them)


def wal_trajectories(run_dir) -> list[Trajectory]:
    with sqlite3.connect(run_dir / "queue.db") as db:
        return [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    import ray

    d = tmp_path_factory.mktemp("shared")
    runs = {"a": ["rollout.temperature=1.0", "run.seed=0", "run.steps=8", "stop.max_generated_tokens=250",
                  "coordinator.keep_consumed=true"],  # (kept: replay of a sync run reads them)
            "b": ["rollout.temperature=0.7", "run.seed=1", "run.steps=6", *BACKPRESSURE]}
    with shared_ray_cluster(SimpleNamespace(shared_ray=True, base=str(TINY), overrides=[])) as address:
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        procs = {name: subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(TINY),
                                         f"run.dir={d / name}", *COMMON, *extra], cwd=REPO, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, extra in runs.items()}
        outs = {name: p.communicate(timeout=900) for name, p in procs.items()}
        jobs = [j for j in ray._private.state.jobs() if not j.get("IsDead") or j.get("DriverPid")]
        for name, p in procs.items():
            assert p.returncode == 0, f"run {name} exited {p.returncode}\n{outs[name][1][-6000:]}"
        # A spent budget stays spent: rerunning A resumes at its last step and runs none.
        rerun = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(TINY),
                                f"run.dir={d / 'a'}", *COMMON, *runs["a"]], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, f"resumed run a exited {rerun.returncode}\n{rerun.stderr[-6000:]}"
    return SimpleNamespace(dir=d, address=address, outs=outs, driver_pids={j.get("DriverPid") for j in jobs},
                           pids={name: p.pid for name, p in procs.items()}, rerun=rerun)


def test_runs_in_one_cluster_do_not_see_each_others_trajectories(two_runs):
    assert two_runs.address and set(two_runs.pids.values()) <= two_runs.driver_pids  # jobs of the one cluster
    for name, temperature in (("a", 1.0), ("b", 0.7)):
        trajs = wal_trajectories(two_runs.dir / name)
        assert trajs, f"run {name}: no trajectories in its queue"
        temps = {t.sampling_config["temperature"] for t in trajs}
        assert temps == {temperature}, f"run {name}'s queue holds trajectories sampled at {temps}"
    steps_b = [r["step"] for r in read_jsonl(two_runs.dir / "b" / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert steps_b == [1, 2, 3, 4, 5, 6]


def test_learner_lag_report_throttles_the_producer(two_runs):
    stdout, stderr = two_runs.outs["b"]
    assert last_json(stdout)["steps"] == 6
    assert "backpressure on (d_lag_p95)" in stderr
    rows = {r["step"]: r for r in read_jsonl(two_runs.dir / "b" / "metrics" / "metrics.jsonl") if "learn/loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step, row in rows.items():
        assert row["queue/backpressure"] == 1 and row["queue/backpressure_d_lag"] == 1, step
        assert row["queue/admission_eta"] == 0, step
    for step in (4, 5, 6):  # rounds 3, 4, 5: admitted under eta 0
        assert rows[step]["queue/taken_dv/p99"] == 0, (step, rows[step]["queue/taken_dv/p99"])


def test_a_generated_token_budget_ends_the_run_checkpointed_with_its_final_eval(two_runs):
    d = two_runs.dir / "a"
    final = last_json(two_runs.outs["a"][0])
    assert final["stopped"] == "max_generated_tokens" and final["generated_tokens"] >= 250
    rows = [r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "system/generated_tokens" in r]
    assert final["steps"] == final["stopped_at_step"] == rows[-1]["step"] < 8  # stopped before run.steps
    assert sum(r["system/generated_tokens"] for r in rows) == final["generated_tokens"]
    assert sum(r["system/generated_tokens"] for r in rows[:-1]) < 250  # the step before had not reached it
    ckpt = d / "checkpoints" / f"step_{final['steps']:06d}"
    assert (ckpt / "COMMITTED").is_file()
    assert (d / "eval" / f"test_step_{final['steps']:06d}.jsonl").is_file()  # the final eval ran
    assert json.loads((d / "stop_condition.json").read_text())["stopped"] == "max_generated_tokens"


def test_a_resumed_run_with_its_budget_spent_logs_its_final_eval_once(two_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = two_runs.dir / "a"
    first, again = last_json(two_runs.outs["a"][0]), last_json(two_runs.rerun.stdout)
    assert again["steps"] == first["steps"] and again["stopped"] == "max_generated_tokens"
    assert again["final_test_correctness"] == first["final_test_correctness"]
    rows = read_jsonl(d / "metrics" / "metrics.jsonl")
    assert [r["step"] for r in rows if "learn/loss" in r] == list(range(1, first["steps"] + 1))  # no step redone
    assert [r["step"] for r in rows if "eval/test_correctness" in r] == [0, first["steps"]]
    acc = EventAccumulator(str(d / "metrics" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/test_correctness")] == [0, first["steps"]]


def test_replay_of_the_six_step_async_run_is_bit_identical(two_runs):
    """Exact replay of an async run of rounds (issue 47 item 4; the streaming one: tests/e2e/test_streaming.py):
    run B's learner side again from its log, no engines and no Ray, every step's loss and grad norm and its
    checkpoint's weight digest bit for bit."""
    report = last_json(run_cli("replay", str(two_runs.dir / "b"), "--json").stdout)
    assert report["identical"] is True and report["first_difference"] is None, report
    assert [r["step"] for r in report["steps"]] == [1, 2, 3, 4, 5, 6]
    assert report["checkpoints"] == {"step_000006": True}


def test_replay_of_the_sync_run_stopped_by_its_budget_is_bit_identical(two_runs):
    """Exact replay of a sync run (issue 47 item 4: sync, async and streaming runs): run A, which its token
    budget stopped and whose rerun resumed it without a step, replays every step and its checkpoint bit for bit."""
    first = last_json(two_runs.outs["a"][0])
    report = last_json(run_cli("replay", str(two_runs.dir / "a"), "--json").stdout)
    assert report["identical"] is True and report["first_difference"] is None, report
    assert [r["step"] for r in report["steps"]] == list(range(1, first["steps"] + 1))
    assert report["checkpoints"] == {f"step_{first['steps']:06d}": True}, report["checkpoints"]
