"""A user's own reward function, from a plugin folder outside the checkout, through the CLI as a user runs
it: `megatron-rl train --config ... reward.function=/their/rewards.py:digit_reward`.

    python -m pytest tests/e2e/test_reward_function.py -q

One run of the tiny recipe, 3 steps, and one of the README's example task, 2 steps (shares the suite's Ray
cluster, tests/e2e/conftest.py): every trajectory names the function's file digest as its grader_version, the
function's components are logged apart, the hidden-test correctness is its "correct" component, and the run's
config.json keeps the function's absolute path.  Dry runs refuse a broken or missing function by name, with no
Ray started (in this process: `_dry_run`; a dry run starts no Ray and no engine).  The three runs (this one,
the README's, the python-API script's) go two at a time (`_runs`); each is read, and checked, by its own fixture.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_rl.cli import main
from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import REPO, TINY, StartedCli, TwoAtATime, cli_env_and_args, last_json, read_jsonl, run_cli
from tests.e2e.conftest import start_cli, wanted

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REWARDS = '''
def digit_reward(*, prompt, response, answer, question, **fields):
    """1 for the right leading digit (correct), 0.1 for starting with any digit (partial credit)."""
    text = response.strip()
    assert question in prompt  # the prompt as the policy saw it holds the question
    return {"correct": float(text[:1] == answer), "digit": 0.1 * float(text[:1].isdigit())}
'''
SHORT = ["run.steps=3", "run.eval_every=0", "data.eval_size=16", "run.checkpoint_every=3"]


@pytest.fixture(scope="module")
def _runs(request, tmp_path_factory):
    """The module's runs, two at a time: `run` beside the README's example, then the python-API script as
    soon as one of them ends.  Only the runs a selected test reads are started."""
    r = SimpleNamespace(queue=TwoAtATime(), plugin=tmp_path_factory.mktemp("plugin") / "rewards.py",
                        d=tmp_path_factory.mktemp("reward_fn") / "run",
                        readme=tmp_path_factory.mktemp("readme") / "run",
                        script_dir=tmp_path_factory.mktemp("api_script"))
    r.plugin.write_text(REWARDS)
    r.script = r.script_dir / "my_script.py"
    r.script.write_text(SCRIPT)
    r.script_run = r.script_dir / "run"
    if wanted(request, "run"):
        r.queue.add("run", lambda: start_cli("train", "--config", str(TINY), f"run.dir={r.d}",
                                             f"reward.function={r.plugin}:digit_reward", *SHORT))
    if wanted(request, "readme_run"):
        r.queue.add("readme", lambda: start_cli("train", "--config", "configs/my_task.example.yaml",
                                                f"run.dir={r.readme}", "run.steps=2", "run.eval_every=0",
                                                "data.eval_size=8", "run.checkpoint_every=0"))
    if wanted(request, "api_script"):
        def script():
            env, args = cli_env_and_args(("train", str(TINY), f"run.dir={r.script_run}", *SHORT))  # the suite's Ray
            return StartedCli([sys.executable, str(r.script), *args[1:]], env, cwd=r.script_dir)
        r.queue.add("script", script)
    yield r
    r.queue.close()


@pytest.fixture(scope="module")
def run(_runs):
    proc = _runs.queue.run("run").result()
    return _runs.d, _runs.plugin, last_json(proc.stdout), proc


@pytest.fixture(scope="module")
def readme_run(_runs):
    """The README's example run, ended (test_the_readmes_example_task_trains_as_a_user_runs_it checks it)."""
    return _runs.readme, _runs.queue.run("readme")


@pytest.fixture(scope="module")
def api_script(_runs):
    """The python-API script's run, ended (test_a_local_callable_through_the_python_api checks it)."""
    return _runs.script, _runs.script_run, _runs.queue.run("script")


def _dry_run(capfd, *args: str) -> subprocess.CompletedProcess:
    """`megatron-rl ARGS --dry-run` in this process (it starts no Ray, no engine, no process): what
    run_cli(..., check=False) would give."""
    assert "--dry-run" in args
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_every_trajectory_names_the_functions_file(run):
    d, plugin, _, _ = run
    digest = hashlib.sha256(plugin.read_bytes()).hexdigest()[:12]
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    assert len(trajs) == 3 * 64
    assert {t.grader_version for t in trajs} == {f"function:digit_reward@{digest}"}
    ok = [t for t in trajs if t.status == "ok"]
    assert ok and all(set(t.reward_components) == {"correct", "digit"} for t in ok)
    assert all(t.reward_components["correct"] in (0.0, 1.0) for t in ok)
    assert json.loads((d / "config.json").read_text())["reward"]["function"] == f"{plugin}:digit_reward"


def test_its_components_are_logged_apart_and_correctness_is_its_correct(run):
    d, _, summary, proc = run
    rows = [r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("learn/reward_correct" in r and "learn/reward_digit" in r for r in rows)
    assert all(r["learn/reward_mean"] == pytest.approx(r["learn/reward_correct"] + r["learn/reward_digit"])
               for r in rows)
    evals = {r["step"]: r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "eval/test_reward" in r}
    assert sorted(evals) == [0, 3]
    assert summary["final_test_correctness"] == pytest.approx(evals[3]["eval/test_correctness"])
    # correctness is the share of right answers (0/1 each), the reward adds the partial credit on top
    assert evals[3]["eval/test_reward"] >= evals[3]["eval/test_correctness"]
    assert summary["steps"] == 3 and "step 3/3" in proc.stderr + proc.stdout


@pytest.mark.parametrize("ref, named", [("{plugin_dir}/absent.py:fn", "does not exist"),
                                        ("{plugin}:nope", "has no attribute 'nope'"),
                                        ("{broken}:fn", "importing")])
def test_the_dry_run_refuses_a_function_that_cannot_be_loaded(run, tmp_path, capfd, ref, named):
    _, plugin, _, _ = run
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('plugin failed at import')\n")
    ref = ref.format(plugin_dir=plugin.parent, plugin=plugin, broken=broken)
    proc = _dry_run(capfd, "train", "--config", str(TINY), f"run.dir={tmp_path / 'run'}", f"reward.function={ref}",
                    "--dry-run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "reward.function" in proc.stderr and named in proc.stderr, proc.stderr[-2000:]
    assert "Started a local Ray instance" not in proc.stderr and not (tmp_path / "run" / "logs").exists()


def test_the_readmes_example_task_trains_as_a_user_runs_it(readme_run):
    """configs/my_task.example.yaml (examples/arithmetic: a JSONL with its own keys and GSM8K's delimiter, a
    reward function graded with math-verify), from the checkout as the README runs it, 2 steps (`_runs`:
    `train --config configs/my_task.example.yaml run.steps=2 run.eval_every=0 data.eval_size=8
    run.checkpoint_every=0`)."""
    d, started = readme_run
    summary = last_json(started.result().stdout)
    assert summary["steps"] == 2 and summary["final_test_correctness"] is not None
    rows = [r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all({"learn/reward_correct", "learn/reward_format"} <= set(r) for r in rows)
    resolved = json.loads((d / "config.json").read_text())
    assert resolved["reward"]["function"].endswith("examples/arithmetic/reward.py:arithmetic_reward")
    assert resolved["data"]["answer_delimiter"] == "####" and resolved["data"]["question_field"] == "problem"


SCRIPT = '''
import json, sys
from megatron_rl import train

HIGH = "5"  # the closure below reads it: the function is shipped by value, not by import


def reward(*, prompt, response, answer, **fields):
    said = response.strip()[:1]
    return {"correct": float(said == answer), "high": 0.1 * float(said >= HIGH)}


if __name__ == "__main__":  # the verifier pool (and vLLM) start processes that import this script
    from megatron_rl import evaluate

    summary = train(sys.argv[1], overrides=sys.argv[2:], reward_function=reward)
    print(json.dumps(summary))
    print(json.dumps({"eval": evaluate(run=summary["run_dir"], limit=8, reward_function=reward)}))
'''


def test_a_local_callable_through_the_python_api(api_script):
    """A user's script: `from megatron_rl import train; train(config, overrides, reward_function=fn)` with fn a
    function of the script itself (a closure over a global), 3 steps, then `evaluate(run=...)` with it
    (`_runs`: `python my_script.py TINY run.dir=... SHORT` in the script's folder, joining the suite's Ray)."""
    script, d, started = api_script
    proc = started.finish()
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summary, evaluated = lines[-2], lines[-1]["eval"]
    assert summary["steps"] == 3 and summary["final_test_correctness"] is not None
    # evaluate() from the same script: the run's checkpoint, scored by the same callable, 8 examples
    assert evaluated["examples"] == 8 and evaluated["grader_version"].startswith("function:reward@")
    assert 0.0 <= evaluated["correctness"] <= 1.0 and evaluated["reward"] >= evaluated["correctness"]
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    versions = {t.grader_version for t in trajs}
    assert len(versions) == 1 and versions.pop().startswith("function:reward@")
    assert all(set(t.reward_components) == {"correct", "high"} for t in trajs if t.status == "ok")
    rows = [r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert len(rows) == 3 and all("learn/reward_high" in r for r in rows)
    assert json.loads((d / "config.json").read_text())["reward"]["function"].startswith("callable:reward@")
    assert str(REPO) not in str(script)  # the user's script lives outside the checkout


def test_a_finished_run_says_so_and_a_changed_lr_is_refused_by_name(run, capfd):
    """Rerunning the finished run (its 3 steps done, final eval logged) starts nothing and says so; a resume
    with another learner.lr or loss.kl_coef is refused naming both, the dry run too; --allow-config-change
    lets it through."""
    d, plugin, summary, _ = run
    common = ["train", "--config", str(TINY), f"run.dir={d}", f"reward.function={plugin}:digit_reward", *SHORT]
    again = run_cli(*common)
    done = last_json(again.stdout)
    assert done["already_done"] is True and done["steps"] == 3
    assert done["final_test_correctness"] == summary["final_test_correctness"]
    assert "already reached step 3 of run.steps 3" in again.stderr + again.stdout
    assert "Started a local Ray instance" not in again.stderr
    for dry in ([], ["--dry-run"]):  # the refusal as a process, then the dry run's in this one
        changed = (*common, "run.steps=4", "learner.lr=0.5", "loss.kl_coef=0.2", *dry)
        proc = _dry_run(capfd, *changed) if dry else run_cli(*changed, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "refusing to resume" in proc.stderr and "learner.lr: 0.001 -> 0.5" in proc.stderr, proc.stderr[-3000:]
        assert "loss.kl_coef: 0.001 -> 0.2" in proc.stderr and "--allow-config-change" in proc.stderr
    allowed = _dry_run(capfd, *common, "run.steps=4", "learner.lr=0.5", "--allow-config-change", "--dry-run")
    assert allowed.returncode == 0, allowed.stderr[-6000:]  # as run_cli's check
    assert json.loads(allowed.stdout[allowed.stdout.index("{"):])["resume_from"].endswith("step_000003")
