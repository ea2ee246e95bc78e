"""An environment of the user's own, by import path, from a package outside the checkout: the example in
examples/two_step_env (a gymnasium-style 2-step game), copied to a plugin folder and named in module form,
`data.env.name=two_step_env.env:TwoStep`, with the folder on the driver's PYTHONPATH only.

    python -m pytest tests/e2e/test_own_environment.py -q

The run joins the suite's shared Ray cluster (tests/e2e/conftest.py), whose workers never had the folder on
their path: the rollout workers that play the episodes can import the class only because the run ships its
package with the Ray job (runtime_env py_modules, EnvConfig.package_dirs).  The tiny tokenizer has no
chat template and none is set: episodes take the plain one, as the log says.  Its options are checked
against the class's config dataclass, by the dry run too.
"""

from __future__ import annotations

import os
import shutil
import sqlite3

import pytest

from megatron_rl.trajectory import Trajectory
from tests.e2e.conftest import REPO, TINY, last_json, read_jsonl, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EPISODES = ["rollout.streaming=true", "rollout.max_tokens=2", "rollout.max_model_len=64", "run.mode=async",
            "run.prompts_per_step=4", "run.group_size=4", "learner.micro_batch_size=16", "run.eval_every=0",
            "run.checkpoint_every=2", "data.eval_size=4", "data.env.name=two_step_env.env:TwoStep",
            "data.env.options={bonus: 0.5}", 'data.env.system_prompt=""', "data.env.max_turns=2",
            "data.env.max_total_tokens=64"]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    shutil.copytree(REPO / "examples" / "two_step_env", root / "two_step_env")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), old]))  # the driver's path only
    yield root
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def run(plugin, tmp_path_factory):
    d = tmp_path_factory.mktemp("own_env") / "run"
    proc = run_cli("train", "--config", str(TINY), f"run.dir={d}", "run.steps=2", *EPISODES)
    with sqlite3.connect(d / "queue.db") as db:
        trajs = [Trajectory.from_bytes(row[0]) for row in db.execute("SELECT payload FROM traj")]
    return d, last_json(proc.stdout), trajs


def test_the_episodes_are_played_by_the_users_class_in_the_rollout_workers(run):
    d, summary, trajs = run
    assert summary["steps"] == 2 and len(trajs) >= 2 * 16
    assert {t.grader_version for t in trajs} == {"env:two_step_env.env:TwoStep"}
    done = [t for t in trajs if t.status == "ok"]
    assert done and all(t.terminal_reason in ("done", "max_turns", "max_tokens") for t in done)
    # 0 (wrong), 0.5 (first right only), 1 (second right only... never: both must be), 1.5 (both right)
    assert {round(t.reward, 3) for t in done} <= {0.0, 0.5, 1.5}
    rollout_log = (d / "logs" / "ray_StreamRolloutWorker.log")
    logs = "".join(p.read_text() for p in (d / "logs").glob("*.log"))
    assert "episodes use the plain one" in logs
    assert rollout_log.exists() or any((d / "logs").glob("ray_*RolloutWorker.log"))
    rows = [r for r in read_jsonl(d / "metrics" / "metrics.jsonl") if "learn/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("bad, named", [
    ("data.env.options={bonus: 2}", "bonus must be in [0, 1]"),
    ("data.env.options={speed: 1}", "unknown config key 'data.env.options.speed'"),
    ("data.env.name=two_step_env.env:Missing", "has no attribute 'Missing'"),
    ("data.env.name=two_step_env.nope:TwoStep", "importing two_step_env.nope failed"),
    ("data.env.name=json:JSONDecoder", "is not a subclass of megatron_rl.envs.protocol.Environment"),
])
def test_the_dry_run_refuses_a_bad_environment_by_name(plugin, tmp_path, bad, named):
    proc = run_cli("train", "--config", str(TINY), f"run.dir={tmp_path / 'run'}", *EPISODES, bad, "--dry-run",
                   check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr, proc.stderr[-2000:]
