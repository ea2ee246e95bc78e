"""A dead rollout engine ends the run with one clear line and the requeue code (issue #12).

    python -m pytest tests/unit/test_publish_failure.py -q

The real CLI, driver and Policy (publication, engine checks), with Roles.build replaced by a
stand-in whose learner's publication fails the way gloo does when a peer dies ("Connection
closed by peer"); the other roles do nothing.  The rollout groups are
real Ray actors; the "dead engine" is one of them killed.  Expected: exit 75 (EXIT_REQUEUE), a
`megatron-rl train: error:` line naming the group and saying that rerunning resumes from the
intact newest checkpoint; a publication failure with every engine alive stays a bug
(traceback), and so does a ValueError inside the loop (not "bad input", exit 2).
"""

from __future__ import annotations

import threading

import pytest
import ray
import torch

from megatron_rl.checkpoint import save_checkpoint
from megatron_rl.cli import main
from megatron_rl.grpo.loss import GRPOLossConfig
from megatron_rl.learner.config import SamplingConfig
from megatron_rl.train import driver
from megatron_rl.ranks.weights import PublishSettings
from megatron_rl.train.policy import Policy, PolicySettings
from megatron_rl.sampling.producer import Round, TrainState
from tests.e2e.conftest import TINY

pytestmark = pytest.mark.unit


@ray.remote(num_cpus=0)
class Engine:
    def policy_version(self) -> int:
        return 0


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class _Learner:
    def __init__(self, fail):
        self.fail = fail
        self.lock, self.updates = threading.RLock(), 0

    def connect_rollout(self, workers, settings):
        pass

    def publish(self, version):
        raise self.fail

    def shutdown(self):
        pass


class _Fleet:
    """Two real engine actors (one killed when `dead`), both members of every publication."""

    def __init__(self, dead: bool):
        self.workers = [Engine.remote(), Engine.remote()]
        ray.get([w.policy_version.remote() for w in self.workers])
        if dead:
            ray.kill(self.workers[1])
        self.unreachable = {}  # groups left out after a publication timeout (none here)

    def set_refitter(self, refitter):
        pass

    def publication_members(self, version):
        return list(self.workers), [0, 1], [], False

    def restart_dead(self, cause):
        return []  # this double cannot restart: a dead engine ends the run (exit 75)


class _Policy(Policy):
    """The real Policy (publication, engine checks) on a learner whose publication fails."""

    def __init__(self, learner, fleet, learn_error=None):
        settings = PolicySettings(loss=GRPOLossConfig(), sampling=SamplingConfig(), micro_batch_size=1, probe_rows=1,
                                  refit_tolerance=None, vocab_size=8, pad_id=0)  # no refit probe in this double
        super().__init__(learner, fleet, settings, PublishSettings())
        self.learn_error = learn_error

    def learn(self, taken, version, lr_scale=1.0):
        if self.learn_error:
            raise self.learn_error
        return {"loss": 0.0, "grad_norm": 0.0, "dv": []}, 0.0  # finite: the restart canary passes


class _Anything:
    """A role whose every method does nothing (the source, scorer, coordinator, reporter)."""

    initial_eval = last_eval = None

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _Source(_Anything):
    error = None  # what the producer thread failed with (surfaced by next, as producer.py does)

    def next(self, step):
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error
        return Round(step, [], [], 0.0)


class _Scorer(_Anything):
    def score(self, samples):
        return [], 0.0


class _Checkpointer:
    def resume(self, policy, source, coordinator):
        return TrainState(step=2, version=2), None


class _Roles:
    def __init__(self, run_dir, fleet, learner, learn_error=None, producer_error=None):
        self.run_dir = run_dir
        self.policy = _Policy(learner, fleet, learn_error)
        self.source, self.scorer, self.coordinator, self.reporter = _Source(), _Scorer(), _Anything(), _Anything()
        self.auditor = _Anything()
        self.source.error = producer_error
        self.checkpointer = _Checkpointer()
        self.closed = False

    def close(self):
        self.closed = True


def _train(monkeypatch, tmp_path, roles_kw):
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints", 2, policy_version=2, config_hash="x",
                    save_fn=lambda d: torch.save({"w": torch.ones(3)}, d / "w.pt"))
    made = {}

    def build(cfg, pool=None, resume_from=None):
        made["roles"] = _Roles(run_dir, **roles_kw)
        return made["roles"]

    monkeypatch.setattr(driver.Roles, "build", staticmethod(build))
    args = ["train", "--config", str(TINY), f"run.dir={run_dir}", "run.steps=4"]
    return args, made


def test_dead_engine_exits_75_with_one_line(ray_local, monkeypatch, tmp_path, capsys):
    fail = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    args, made = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=True), learner=_Learner(fail)))
    assert main(args) == driver.EXIT_REQUEUE
    err = capsys.readouterr().err.strip().splitlines()
    line = [x for x in err if x.startswith("megatron-rl train: error:")]
    assert len(line) == 1 and "Traceback" not in "\n".join(err)
    assert "rollout group 1" in line[0] and "rollout group 0" not in line[0]
    assert "step_000002 is intact" in line[0] and "rerun" in line[0]
    assert made["roles"].closed


def test_publication_failure_with_live_engines_is_not_hidden(ray_local, monkeypatch, tmp_path):
    args, _ = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=False), learner=_Learner(RuntimeError("boom"))))
    with pytest.raises(RuntimeError, match="boom"):
        main(args)


def test_value_error_in_the_loop_is_a_bug_not_bad_input(ray_local, monkeypatch, tmp_path):
    args, _ = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=False), learner=_Learner(RuntimeError()),
                                                 learn_error=ValueError("shape mismatch")))
    with pytest.raises(RuntimeError, match="internal error while training: shape mismatch"):
        main(args)


def test_engine_that_keeps_dying_exits_75(ray_local, monkeypatch, tmp_path, capsys):
    from megatron_rl.rollout.fleet import RolloutFailed

    failed = RolloutFailed("the vLLM engine of rollout group 0 died again after 3 restarts this run: EngineDeadError")
    args, _ = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=False), learner=_Learner(RuntimeError()),
                                                 producer_error=failed))
    assert main(args) == driver.EXIT_REQUEUE
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("megatron-rl train: error:")]
    assert len(line) == 1 and "rollout group 0 died again" in line[0] and "step_000002 is intact" in line[0]


@pytest.mark.parametrize("error, code", [
    ("oom", driver.EXIT_OOM),  # the learner's own RuntimeErrors keep their exit codes
    ("canary", 88),
])
def test_learner_stops_keep_their_exit_codes(ray_local, monkeypatch, tmp_path, error, code):
    from megatron_rl.ranks.group import LearnerOutOfMemory
    from megatron_rl.train.restart import CanaryFailed

    exc = LearnerOutOfMemory("out of memory at micro_batch_size 64 and again at 32") if error == "oom" \
        else CanaryFailed("canary step 3: loss is nan")
    args, _ = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=False), learner=_Learner(RuntimeError()),
                                                 learn_error=exc))
    assert main(args) == code


def test_a_group_restarted_by_generation_meanwhile_is_published_to_again():
    # A streaming engine dies paused in a refit: the publication is refused with EngineDeadError, and the
    # generation path, whose requests died with it, restarts the group first -- restart_dead then finds every
    # group alive.  The publication must go once more (refitting the restarted group), not fail the run.
    dead = "rollout group 0: vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."

    class Fleet:
        workers, unreachable, passes = ["engine-a"], {}, []

        def set_refitter(self, refitter):
            pass

        def publication_members(self, version):
            return list(self.workers), [0], [], self.workers[0] != "engine-a"

        def regrouped(self, workers):
            pass

        def refitted(self, version, workers, stale):
            self.passes.append(list(workers))

        def restart_dead(self, cause):
            return []  # the generation path got there first

    class Learner(_Learner):
        def publish(self, version):
            if fleet.workers[0] == "engine-a":
                fleet.workers[0] = "engine-b"  # restarted by the generation path while this pass failed
                return {"committed": False, "errors": [dead], "groups": [{"unresponsive": False, "committed": False,
                                                                           "error": dead}]}
            return {"committed": True, "errors": [], "groups": [{"unresponsive": False, "committed": True}],
                    "digest": "d2"}

    fleet = Fleet()
    policy = _Policy(Learner(None), fleet)
    assert policy.publish(2) is not None
    assert fleet.passes == [["engine-a"], ["engine-b"]] and policy.digests == {"2": "d2"}
