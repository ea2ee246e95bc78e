"""A run inside the experiment runner's process, on an engine handed over by the run before it, gives
what the same run gives as its own process.

    python -m pytest tests/e2e/test_experiment_inprocess.py -q      # through /work/heavy (~3 min)

One tiny experiment (SFT 2 steps twice, then two GRPO arms of 2 steps from the first, one seed) runs
with the defaults: all runs inside the runner (`runner: pooled`) against its shared Ray cluster, and the second
GRPO run (`again`, another rollout.max_tokens) takes the first one's rollout engine, learner actor
and placement group from the runner's pool (train/engine_pool.py): the engine refitted with its
initial weights, the learner rebuilt in its process.
Then that run's command line runs again, cold: its own process, its own Ray, its own engine.  Every
learning, numerics, reward and eval value of every step, the per-example hidden-test outcomes and
the final JSON line must be equal; only timing and queue gauges may differ.  The second SFT run
(`sft_again`, the first one's config and seed) runs in the learner actor the first one parked, and
must give every value of the first.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import pytest

from megatron_rl.experiment.config import load_experiment
from megatron_rl.experiment.runs import plan_run
from tests.e2e.conftest import TINY, last_json, read_jsonl, start_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.own_ray("the cold run is the point: its own process, Ray and engine against the warm ones")]

TIMING = ("system/", "latency/", "queue/", "time")  # clocks and snapshot gauges (differ run to run)


@pytest.fixture(scope="module")
def warm_and_cold(tmp_path_factory):
    d = tmp_path_factory.mktemp("inprocess")
    path = d / "exp.yaml"
    path.write_text(json.dumps({
        "base": str(TINY), "dir": str(d / "exp"), "seeds": [0],
        "overrides": ["data.eval_size=8", "run.eval_every=0", "run.checkpoint_every=0"],
        "preregistration": {"hypothesis": "in-process runs equal cold runs", "baseline_arm": "sft"},
        "arms": {"sft": {"command": "sft", "overrides": ["sft.steps=2"]},
                 "sft_again": {"command": "sft", "overrides": ["sft.steps=2"]},
                 "grpo": {"command": "train", "init_from": "sft", "overrides": ["run.steps=2"]},
                 "again": {"command": "train", "init_from": "sft",
                           "overrides": ["run.steps=2", "rollout.max_tokens=3"]}}}))
    experiment = start_cli("experiment", "--config", str(path))
    cfg = load_experiment(path)
    cold_dir = d / "cold"
    args = [a for a in plan_run(cfg, "again", 0).argv() if not a.startswith(("run.dir=", "run.use_existing_ray="))]
    runs = d / "exp" / "runs"
    # The cold run starts from the sft arm's checkpoint, which the first GRPO run exports on first use
    # (train/start_model.py; into a hidden .step_N.partial-* folder renamed step_N when complete): it starts
    # once that export is there, beside the rest of the experiment (two runs at a time; no test here reads
    # timing), else at the experiment's end.
    while experiment.running() and not list((runs / "sft" / "seed_0" / "export").glob("step_*/config.json")):
        time.sleep(1)
    if not experiment.running():
        experiment.result()  # fails here if the experiment did
    cold_run = start_cli(*args, f"run.dir={cold_dir}")
    try:
        experiment.result()
        cold = cold_run.result()
    finally:
        cold_run.kill()  # the experiment failed first; a finished run is left as it is
    return SimpleNamespace(warm=runs / "again" / "seed_0", first=runs / "grpo" / "seed_0", cold=cold_dir,
                           sft=runs / "sft" / "seed_0", sft_again=runs / "sft_again" / "seed_0",
                           warm_final=last_json((d / "exp" / "logs" / "again_seed_0.log").read_text()),
                           cold_final=last_json(cold.stdout))


def _pid(run_dir) -> int:
    return json.loads((run_dir / "run_manifest.json").read_text())["attempts"][-1]["pid"]


def _actor_pids(run_dir, actor: str = "RolloutWorker") -> set[str]:
    """The process ids of a run's actors of one kind, from their output in the run's own logs."""
    text = (run_dir / "logs" / f"ray_{actor}.log").read_text()
    return set(re.findall(r"^\(pid=(\d+)", text, flags=re.M))


def test_all_runs_ran_in_the_runner_process(warm_and_cold):
    r = warm_and_cold
    assert _pid(r.sft) == _pid(r.sft_again) == _pid(r.first) == _pid(r.warm) != _pid(r.cold)
    assert (r.warm / "result.json").is_file() and (r.warm / "checkpoints" / "step_000002" / "COMMITTED").is_file()
    for actor in ("LearnerWorker", "RolloutWorker"):  # its actors' output in its own run dir, as a process's
        log = r.warm / "logs" / f"ray_{actor}.log"
        assert log.is_file() and log.stat().st_size > 0, f"{log} missing or empty"


@pytest.mark.parametrize("actor", ["RolloutWorker", "LearnerWorker"])
def test_the_second_grpo_run_ran_in_the_first_runs_actors(warm_and_cold, actor):
    r = warm_and_cold
    first, again, cold = _actor_pids(r.first, actor), _actor_pids(r.warm, actor), _actor_pids(r.cold, actor)
    assert len(first) == 1 and again == first and cold.isdisjoint(first)
    driver = (r.warm / "logs" / "driver.log").read_text()
    assert f"{'rollout engine' if actor == 'RolloutWorker' else 'learner actor'}(s) of the previous run handed" \
        in driver
    if actor == "RolloutWorker":  # refitted with the run's initial weights, checked by the probe
        assert "refit check of version 0" in (r.warm / "logs" / "ray_RolloutWorker.log").read_text()


def _values(run_dir) -> dict:
    """Every metric of every step but clocks and queue gauges."""
    rows: dict = {}
    for row in read_jsonl(run_dir / "metrics" / "metrics.jsonl"):
        rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if not k.startswith(TIMING)})
    return rows


def test_an_sft_run_in_the_last_sft_runs_learner_equals_it(warm_and_cold):
    """`sft_again` is `sft` once more (same config and seed) in the learner actor `sft` parked."""
    r = warm_and_cold
    assert _actor_pids(r.sft_again, "LearnerWorker") == _actor_pids(r.sft, "LearnerWorker")
    assert "learner actor(s) of the previous run handed" in (r.sft_again / "logs" / "driver.log").read_text()
    first, again = _values(r.sft), _values(r.sft_again)
    assert first.keys() == again.keys() and any("sft/loss" in v for v in first.values())
    assert first == again
    outcomes = [read_jsonl(d / "eval" / "test_step_000002.jsonl") for d in (r.sft, r.sft_again)]
    assert outcomes[0] == outcomes[1] and len(outcomes[0]) == 8


def test_a_run_in_process_equals_the_cold_run(warm_and_cold):
    r = warm_and_cold
    warm, cold = _values(r.warm), _values(r.cold)
    assert warm.keys() == cold.keys() and any("learn/loss" in v for v in warm.values())
    diffs = {(s, k): (warm[s].get(k), cold[s].get(k)) for s in warm for k in warm[s].keys() | cold[s].keys()
             if warm[s].get(k) != cold[s].get(k)}
    assert not diffs, f"in-process vs cold: {diffs}"
    outcomes = [read_jsonl(d / "eval" / "test_step_000002.jsonl") for d in (r.warm, r.cold)]
    assert outcomes[0] == outcomes[1] and len(outcomes[0]) == 8
    keep = {k: v for k, v in r.cold_final.items() if not k.endswith(("_s", "_seconds")) and k != "run_dir"}
    assert {k: r.warm_final.get(k) for k in keep} == keep
    result = json.loads((r.warm / "result.json").read_text())
    assert result["steps"] == r.cold_final["steps"] == 2
    assert result["generated_tokens"] == r.cold_final["generated_tokens"]
