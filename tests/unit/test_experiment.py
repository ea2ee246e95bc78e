"""Experiments: the pre-registration is fixed before any run, finished runs are not rerun, and the
paired bootstrap agrees with cases whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from types import SimpleNamespace

from megatron_rl.config import ConfigError
from megatron_rl.experiment.config import Preregistration, load_experiment
from megatron_rl.experiment.runner import preregister, run_all
from megatron_rl.experiment.runs import Outcome, plan_run
from megatron_rl.experiment.report import paired_difference_ci, verdict, write_report

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _experiment(tmp_path, hypothesis="GRPO beats SFT", seeds=(0, 1, 2), preregistration_test=None, **fields):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({
        "shared_ray": False,  # unit tests: no Ray (tests/e2e/test_shared_ray.py runs the shared cluster)
        **fields,
        "base": str(REPO / "configs" / "tiny_cpu.yaml"), "dir": str(tmp_path / "exp"), "seeds": list(seeds),
        "preregistration": {"hypothesis": hypothesis, "baseline_arm": "sft", "minimal_effect": 0.05,
                            **({"test": preregistration_test} if preregistration_test else {})},
        "arms": {"sft": {"command": "sft", "overrides": ["sft.steps=3"]},
                 "grpo": {"command": "train", "init_from": "sft", "overrides": ["run.steps=4"]}}}))
    return load_experiment(path)


def command_for(cfg, arm: str, seed: int) -> list[str]:
    return plan_run(cfg, arm, seed).argv()


def _fake_run(correct_by_arm):
    """Test double for launching a real run: writes what a finished run leaves behind, and returns its
    summary (a log line after the summary line, and none of it in the log, show nothing reads the log)."""
    calls = []

    def launch(run, log):
        args = list(run.overrides)
        calls.append(args)
        d = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.dir=")))
        arm = d.parent.name
        (d / "eval").mkdir(parents=True)
        (d / "metrics").mkdir()
        rng = np.random.default_rng(len(calls))
        with (d / "eval" / "test_step_000004.jsonl").open("w") as f:
            for i in range(50):
                right = rng.random() < correct_by_arm[arm]
                f.write(json.dumps({"id": f"e{i}", "answer": "7", "responses": ["7" if right else f"{arm} says 3"],
                                    "correctness": [float(right)]}) + "\n")
        (d / "metrics" / "metrics.jsonl").write_text(json.dumps({"step": 1, "learn/response_length": 2.0}) + "\n")
        (d / "config.json").write_text(json.dumps({"run": {"prompts_per_step": 8, "group_size": 8}}))
        log.parent.mkdir(parents=True, exist_ok=True)
        budget = next((int(a.split("=")[1]) for a in args if a.startswith("stop.max_generated_tokens=")), None)
        log.write_text('INFO a log line\n{"steps": 99}\n')
        return Outcome(0, {"steps": 3, "generated_tokens": 1100, "test_correctness": 0.5,
                           **({"stopped": "max_generated_tokens"} if budget else {})})

    return launch, calls


def test_preregistration_is_written_first_and_cannot_change(tmp_path):
    cfg = _experiment(tmp_path)
    launch, calls = _fake_run({"sft": 0.3, "grpo": 0.9})
    seen_before_first_run = []
    run_all(cfg, lambda r, l: (seen_before_first_run.append((Path(cfg.dir) / "preregistration.json").is_file())
                               or launch(r, l)))
    assert seen_before_first_run and all(seen_before_first_run)
    registered = (Path(cfg.dir) / "preregistration.json").read_text()
    preregister(cfg)  # the same experiment again: accepted, file untouched
    assert (Path(cfg.dir) / "preregistration.json").read_text() == registered
    with pytest.raises(ValueError, match="cannot change after runs started"):
        preregister(_experiment(tmp_path, hypothesis="something else"))


def test_interrupted_experiment_resumes_without_rerunning_finished_runs(tmp_path):
    cfg = _experiment(tmp_path)
    launch, calls = _fake_run({"sft": 0.3, "grpo": 0.9})

    def dies_on_third(run, log):
        if len(calls) == 2:
            return Outcome(1)  # the third run fails: the experiment stops there
        return launch(run, log)

    with pytest.raises(RuntimeError, match="rerun the experiment to resume"):
        run_all(cfg, dies_on_third)
    assert len(calls) == 2
    ran = run_all(cfg, launch)
    assert ran == [("sft", 2), ("grpo", 0), ("grpo", 1), ("grpo", 2)]  # the two finished ones skipped
    grpo_args = calls[-1]
    assert f"model.init_from={Path(cfg.dir) / 'runs' / 'sft' / 'seed_2'}" in grpo_args and "run.seed=2" in grpo_args
    report = write_report(cfg)
    grpo = report["arms"]["grpo"]
    assert grpo["pairs"] == 150 and grpo["ci"][0] > 0.4 and grpo["verdict"] == "supported"
    text = (Path(cfg.dir) / "report.md").read_text()
    results, rest = text.split("## Cost")
    assert results.count("| grpo |") == 1 and rest.count("| grpo |") == 1  # one row per table
    failures = report["arms"]["sft"]["failures"]  # the first seed's wrong answers, as the run gave them
    assert 1 <= len(failures) <= 3 and all(f["response"] == "sft says 3" and f["answer"] == "7" for f in failures)
    assert f"- sft: `{failures[0]['id']}` answer '7', response 'sft says 3'" in rest
    assert "## Estimated or not run" in rest and "CPU-hours are estimated" in rest
    assert (Path(cfg.dir) / "test_correctness.png").stat().st_size > 0


def test_paired_bootstrap_matches_known_answers():
    rng = np.random.default_rng(0)
    base = rng.normal(0.0, 1.0, 4000)
    arm = base + 0.3 + rng.normal(0.0, 0.5, 4000)  # paired differences ~ N(0.3, 0.5^2)
    mean, lo, hi = paired_difference_ci(arm, base, alpha=0.05, resamples=2000)
    half = 1.96 * (arm - base).std(ddof=1) / np.sqrt(4000)
    assert mean == pytest.approx(float((arm - base).mean()))
    assert lo == pytest.approx(mean - half, abs=0.004) and hi == pytest.approx(mean + half, abs=0.004)
    # The pairing matters: the same numbers unpaired would give an interval ~2x wider.
    assert (hi - lo) < 0.6 * 2 * 1.96 * np.sqrt(arm.var(ddof=1) / 4000 + base.var(ddof=1) / 4000)
    same = paired_difference_ci(np.ones(10), np.zeros(10), alpha=0.05)
    assert same == (1.0, 1.0, 1.0)  # every pair differs by exactly 1


def test_few_seeds_is_exploratory(tmp_path):
    cfg = _experiment(tmp_path, seeds=(0,))
    launch, _ = _fake_run({"sft": 0.3, "grpo": 0.9})
    run_all(cfg, launch)
    assert write_report(cfg)["arms"]["grpo"]["verdict"] == "exploratory"


def test_a_bad_override_is_refused_before_any_run(tmp_path):
    cfg = _experiment(tmp_path)
    cfg.arms["grpo"].overrides.append("learner.lr_typo=1")
    launch, calls = _fake_run({"sft": 0.3, "grpo": 0.9})
    with pytest.raises(ValueError, match=r"arms.grpo \(seed 0\): .*learner.lr_typo"):
        run_all(cfg, launch)
    assert calls == [] and not (Path(cfg.dir) / "preregistration.json").exists()


def test_runs_get_the_budget_the_shared_cluster_and_the_in_process_engine(tmp_path):
    cfg = _experiment(tmp_path, budget_generated_tokens=1000, shared_ray=True)
    sft, grpo = command_for(cfg, "sft", 0), command_for(cfg, "grpo", 0)
    assert "stop.max_generated_tokens=1000" in grpo and not any("max_generated_tokens" in a for a in sft)
    for args in (sft, grpo):  # both connect to the runner's cluster; TP 1: the engine runs in its actor
        assert "run.use_existing_ray=true" in args and "rollout.engine_in_process=true" in args
    off = _experiment(tmp_path, engine_in_process=False)
    assert not any(a.startswith(("rollout.engine_in_process", "run.use_existing_ray", "stop.max_generated"))
                   for a in command_for(off, "grpo", 0))
    tp2 = _experiment(tmp_path, overrides=["rollout.tensor_parallel_size=2"])
    assert "rollout.engine_in_process=true" not in command_for(tp2, "grpo", 0)  # TP 2 keeps its worker processes


def test_the_budget_is_preregistered_and_each_result_records_what_stopped_the_run(tmp_path):
    cfg = _experiment(tmp_path, budget_generated_tokens=1000)
    launch, calls = _fake_run({"sft": 0.3, "grpo": 0.9})
    run_all(cfg, launch)
    assert json.loads((Path(cfg.dir) / "preregistration.json").read_text())["budget_generated_tokens"] == 1000
    grpo = json.loads((Path(cfg.dir) / "runs" / "grpo" / "seed_0" / "result.json").read_text())
    assert grpo["stopped"] == "max_generated_tokens" and grpo["generated_tokens"] == 1100 and grpo["steps"] == 3
    assert "test_correctness" not in grpo  # only what result.json keeps of the summary
    sft = json.loads((Path(cfg.dir) / "runs" / "sft" / "seed_0" / "result.json").read_text())
    assert "stopped" not in sft
    with pytest.raises(ValueError, match="cannot change after runs started"):  # a different budget is a new design
        preregister(_experiment(tmp_path, budget_generated_tokens=2000))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "lots"])
def test_a_bad_budget_names_its_field(tmp_path, bad):
    with pytest.raises(ValueError, match="budget_generated_tokens"):
        _experiment(tmp_path, budget_generated_tokens=bad)


def _bad_experiment(tmp_path, data: dict) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_experiment(path)
    return str(info.value)


def test_an_experiment_file_with_missing_keys_and_a_typo_names_them_all(tmp_path, capsys):
    """Issue 30, defect 4: Python's "__init__() missing 3 required keyword-only arguments" named no
    YAML key, and an unknown arm command went unreported while a key was missing."""
    data = {"preregistration": {"baseline_arm": "sft"}, "arms": {"sft": {"command": "trian"}}}
    err = _bad_experiment(tmp_path, data)
    assert err.startswith("4 problems:") and "__init__" not in err, err
    for problem in ("missing config key 'base'", "missing config key 'dir'",
                    "missing config key 'preregistration.hypothesis'",
                    "arms.sft.command: 'trian' is not one of ['sft', 'train']"):
        assert problem in err, (problem, err)
    # The command: exit 2, every problem on its own line.
    from megatron_rl.cli import main

    assert main(["experiment", "--config", str(tmp_path / "bad.yaml"), "--dry-run"]) == 2
    out = capsys.readouterr()
    assert "missing config key 'preregistration.hypothesis'" in out.err and "'trian'" in out.err, out.err


def test_every_problem_of_an_experiment_file_is_reported_in_one_pass(tmp_path):
    """Unknown keys, missing keys, wrong values and the checks across fields (baseline arm, init_from,
    seeds) of the fields that could be read, all in one error."""
    data = {"base": str(REPO / "configs" / "tiny_cpu.yaml"), "nope": 1, "seeds": [1, 1],
            "preregistration": {"hypothesis": "h", "baseline_arm": "base"},
            "arms": {"sft": {"command": "sft"}, "grpo": {"command": "train", "init_from": "ghost", "overide": []}}}
    err = _bad_experiment(tmp_path, data)
    for problem in ("unknown config key 'nope'", "missing config key 'dir'", "unknown config key 'arms.grpo.overide'"):
        assert problem in err, (problem, err)
    data["arms"]["grpo"].pop("overide")  # arms readable: the checks across arms run with the rest
    err = _bad_experiment(tmp_path, data)
    assert err.startswith("5 problems:"), err
    for problem in ("unknown config key 'nope'", "missing config key 'dir'",
                    "preregistration.baseline_arm 'base' is not an arm (['grpo', 'sft'])",
                    "arms.grpo.init_from 'ghost' is not an arm", "seeds must be distinct and non-empty, got [1, 1]"):
        assert problem in err, (problem, err)
    cycle = {**data, "dir": "x", "nope": None, "seeds": [0], "preregistration": {"hypothesis": "h", "baseline_arm": "a"},
             "arms": {"a": {"init_from": "b"}, "b": {"init_from": "a"}, "c": {"init_from": "a"}}}
    del cycle["nope"]
    assert _bad_experiment(tmp_path, cycle) == "arms.*.init_from forms a cycle among ['a', 'b', 'c']"


def test_runner_is_one_field_of_three_values(tmp_path):
    assert _experiment(tmp_path).runner == "pooled"  # the default: in the runner's process, engines pooled
    for runner in ("process", "in_process", "pooled"):
        assert _experiment(tmp_path, runner=runner).runner == runner
    with pytest.raises(ValueError, match=r"runner: 'threads' is not one of \['process', 'in_process', 'pooled'\]"):
        _experiment(tmp_path, runner="threads")


@pytest.mark.parametrize("old, runner", [
    ({"in_process": False}, "process"), ({"in_process": True}, "pooled"),
    ({"in_process": True, "pool_engines": False}, "in_process"), ({"pool_engines": False}, "in_process"),
    ({"in_process": False, "pool_engines": True}, "process"), ({"pool_engines": True}, "pooled")])
def test_the_replaced_keys_are_refused_with_the_new_spelling(tmp_path, old, runner):
    with pytest.raises(ValueError) as info:
        _experiment(tmp_path, **old)
    for key in old:
        assert f"experiment key {key} was replaced by runner: {runner} (one of process | in_process | pooled)" \
            in str(info.value)
    assert "unknown config key" not in str(info.value)


def test_a_replaced_key_is_named_with_the_other_problems_of_the_file(tmp_path):
    err = _bad_experiment(tmp_path, {"in_process": False, "nope": 1, "dir": "x", "base": "b",
                                     "preregistration": {"hypothesis": "h", "baseline_arm": "a"},
                                     "arms": {"a": {}}})
    assert err.startswith("2 problems:"), err
    assert "experiment key in_process was replaced by runner: process" in err and "unknown config key 'nope'" in err


def test_the_run_overrides_are_built_once_as_data(tmp_path):
    cfg = _experiment(tmp_path, overrides=["data.eval_size=8"])
    run = plan_run(cfg, "grpo", 1)
    assert (run.arm, run.seed, run.command, run.base) == ("grpo", 1, "train", cfg.base)
    assert run.overrides[:2] == ("data.eval_size=8", "run.steps=4")
    assert run.argv() == ["train", "--config", cfg.base, *run.overrides]
    assert run.argv(Path("s.json"))[3:5] == ["--summary-out", "s.json"]
    loaded = run.config()  # the config comes from the overrides as data, not from a command line
    assert (loaded.run.seed, loaded.learner.seed, loaded.data.eval_size) == (1, 1001, 8)
    assert loaded.model.init_from == str(Path(cfg.dir) / "runs" / "sft" / "seed_1") and loaded.sft.first is False
    assert "run.use_existing_ray=true" in plan_run(cfg, "grpo", 1, existing_ray=True).overrides
    assert "run.use_existing_ray=true" not in run.overrides  # shared_ray is off in these tests


EXPERIMENTS = sorted((REPO / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_every_experiment_file_validates(path, capsys):
    from megatron_rl.cli import main

    assert main(["experiment", "--config", str(path), "--dry-run"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["runner"] in ("process", "in_process", "pooled") and len(out["runs"]) == len(out["order"]) * len(
        out["seeds"])


def test_what_was_not_run_is_named_in_the_report(tmp_path):
    cfg = _experiment(tmp_path, not_run=["the colocated arm (needs a GPU)"])
    launch, _ = _fake_run({"sft": 0.3, "grpo": 0.9})
    run_all(cfg, launch)
    report = write_report(cfg)
    assert report["not_run"] == ["the colocated arm (needs a GPU)"]
    assert "- Not run: the colocated arm (needs a GPU)" in (Path(cfg.dir) / "report.md").read_text()


def test_a_runs_costs_hold_its_step_time_p99_and_its_longest_response(tmp_path):
    # The architecture experiment's columns: step-time P99 over the run's steps, the longest response of any step.
    from megatron_rl.experiment.report import run_costs

    (tmp_path / "metrics").mkdir()
    rows = [{"step": s, "system/time_step_s": float(s), "learn/response_length": 2.0,
             "learn/response_length_max": float(2 + (s == 37) * 22)} for s in range(1, 101)]
    rows.append({"step": 100, "eval/test_correctness": 0.9})  # an eval row holds neither
    (tmp_path / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"run": {"prompts_per_step": 8, "group_size": 8}}))
    (tmp_path / "result.json").write_text(json.dumps({"wall_s": 10.0}))
    costs = run_costs(tmp_path)
    assert costs["step_time_p99_s"] == pytest.approx(99.01)
    assert costs["response_length_max"] == 24.0
    assert costs["loop_s"] == sum(range(1, 101))


def test_the_verdict_follows_the_registered_test():
    """Superiority (the default) against non-inferiority, on the same intervals; testbed_normalisation's
    sequence - token -0.018 [-0.038, +0.002] is non-inferior at 0.05, and not a superiority result."""
    three = SimpleNamespace(seeds=[0, 1, 2])
    sup = Preregistration(hypothesis="h", baseline_arm="b", minimal_effect=0.05)
    non = Preregistration(hypothesis="h", baseline_arm="b", minimal_effect=0.05, test="non_inferiority")
    cases = [((0.10, 0.06, 0.14), "supported", "supported"),
             ((0.03, 0.01, 0.05), "inconclusive", "supported"),   # above 0, below the minimal effect
             ((-0.018, -0.038, 0.002), "inconclusive", "supported"),
             ((-0.04, -0.08, -0.01), "contradicted", "inconclusive"),
             ((-0.10, -0.14, -0.06), "contradicted", "contradicted")]
    for (diff, lo, hi), want_sup, want_non in cases:
        assert verdict(diff, lo, hi, sup, three) == want_sup, (diff, lo, hi)
        assert verdict(diff, lo, hi, non, three) == want_non, (diff, lo, hi)
    assert verdict(0.10, 0.06, 0.14, non, SimpleNamespace(seeds=[0])) == "exploratory"
    with pytest.raises(ConfigError, match="preregistration.test must be 'superiority' or 'non_inferiority'"):
        Preregistration(hypothesis="h", baseline_arm="b", test="equivalence")


def test_a_non_inferiority_test_is_part_of_the_registration(tmp_path):
    """A superiority registration is written as before (older experiment dirs still match); a non-inferiority
    one records its test, and changing the test after runs started is refused."""
    preregister(_experiment(tmp_path))
    assert "test" not in json.loads((tmp_path / "exp" / "preregistration.json").read_text())["preregistration"]
    with pytest.raises(ValueError, match="cannot change after runs started"):
        preregister(_experiment(tmp_path, preregistration_test="non_inferiority"))
    other = tmp_path / "other"
    other.mkdir()
    preregister(_experiment(other, preregistration_test="non_inferiority"))
    assert json.loads((other / "exp" / "preregistration.json").read_text())["preregistration"]["test"] == \
        "non_inferiority"
