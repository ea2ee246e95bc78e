"""A dead rollout engine ends the run with one clear line and the requeue code (issue #12).

    python -m pytest tests/unit/test_publish_failure.py -q

The real CLI and driver, with Roles.build replaced by a stand-in whose learner's publication
fails the way gloo does when a peer dies ("Connection closed by peer").  The rollout groups are
real Ray actors; the "dead engine" is one of them killed.  Expected: exit 75 (EXIT_REQUEUE), a
`megatron-rl train: error:` line naming the group and saying that rerunning resumes from the
intact newest checkpoint; a publication failure with every engine alive stays a bug
(traceback), and so does a ValueError inside the loop (not "bad input", exit 2).
"""

from __future__ import annotations

import pytest
import ray
import torch

from megatron_rl.checkpoint import save_checkpoint
from megatron_rl.cli import main
from megatron_rl.metrics import MetricsLogger
from megatron_rl.train import driver
from megatron_rl.train.producer import TrainState
from megatron_rl.train.roles import Roles
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

    def publish(self, version):
        raise self.fail


class _Producer:
    error = None  # what the producer thread failed with (surfaced by next, as producer.py does)

    def start(self, state):
        pass

    def next(self, step):
        if self.error is not None:
            raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error
        return [], [], 0.0

    def stop(self):
        pass


class _Fleet:
    def __init__(self, dead: bool):
        self.workers = [Engine.remote(), Engine.remote()]
        ray.get([w.policy_version.remote() for w in self.workers])
        if dead:
            ray.kill(self.workers[1])
        self.learner = None  # set by _Roles

    def publish(self, version):  # RolloutFleet.publish: the learner publishes to every group
        return self.learner.publish(version)


class _Roles:
    """Everything but publication is a no-op; publish is the real Roles.publish."""

    publish = Roles.publish
    _raise_if_engine_down = Roles._raise_if_engine_down

    def __init__(self, run_dir, fleet, learner, learn_error=None, producer_error=None):
        self.run_dir, self.fleet, self.learner, self.learn_error = run_dir, fleet, learner, learn_error
        fleet.learner = learner
        self.producer_error = producer_error
        self.metrics = MetricsLogger()  # no sinks
        self.closed = False

    def resume(self):
        return TrainState(step=2, version=2)

    def producer(self):
        producer = _Producer()
        producer.error = self.producer_error
        return producer

    def score(self, step, samples):
        return [], 0.0

    def enqueue(self, trajs, leases):
        return {}

    def take(self, step, version):
        return []

    def learn(self, taken, version, lr_scale=1.0):
        if self.learn_error:
            raise self.learn_error
        return {"loss": 0.0, "grad_norm": 0.0}, 0.0  # finite: the restart canary passes

    def record_consumed(self, step, taken):
        pass

    def _expect_probe(self, version):  # no refit probe in this double
        pass

    def close(self):
        self.closed = True


def _train(monkeypatch, tmp_path, roles_kw):
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir / "checkpoints", 2, policy_version=2, config_hash="x",
                    save_fn=lambda d: torch.save({"w": torch.ones(3)}, d / "w.pt"))
    made = {}

    def build(cfg):
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
    from megatron_rl.train.learner_group import LearnerOutOfMemory
    from megatron_rl.train.restart import CanaryFailed

    exc = LearnerOutOfMemory("out of memory at micro_batch_size 64 and again at 32") if error == "oom" \
        else CanaryFailed("canary step 3: loss is nan")
    args, _ = _train(monkeypatch, tmp_path, dict(fleet=_Fleet(dead=False), learner=_Learner(RuntimeError()),
                                                 learn_error=exc))
    assert main(args) == code
