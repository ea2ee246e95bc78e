"""A rollout group whose engine dies mid-generation is restarted stale, refitted, and its requests retried.

    python -m pytest tests/unit/test_fleet_restart.py -q

The real RolloutFleet (megatron_rl/rollout/fleet.py) over Ray actors that stand in for vLLM engines:
the test double is the engine whose death is injected (its process exits inside `generate`), and a
learner whose publication sets each group's version.  What must hold: no sample of a restarted group
before it holds the published version, the in-flight requests retried and counted, the publication
group formed anew with the replacement, and no refit while the learner's weights moved past the
version it would publish.
"""

from __future__ import annotations

import os
import threading

import pytest
import ray

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet import STALE, RolloutFleet
from megatron_rl.rollout.sample import RolloutSample

pytestmark = pytest.mark.unit


@ray.remote(num_cpus=0, max_restarts=0)
class Engine:
    def __init__(self, stale: bool):
        self.version = None if stale else 0
        self.dies = False
        self.probes = []

    def arm_death(self) -> None:
        self.dies = True

    def generate(self, prompts, sampling, n, extra):
        if self.dies:
            os._exit(1)  # the injected failure: the engine process is gone mid-call
        if self.version is None:
            raise RuntimeError("this rollout group holds no complete policy version (restarted)")
        return [RolloutSample(prompt_tokens=list(p), response_tokens=[1], behavior_logprobs=[0.0],
                              policy_versions=[self.version], sampling=dict(sampling), finish_reason="stop",
                              started_at=0.0, finished_at=0.0, extra=dict(e))
                for p, e in zip(prompts, extra) for _ in range(n)]

    def policy_version(self):
        return self.version

    def receive(self, version: int) -> None:
        self.version = version

    def expect_probe(self, version, sequences, logprobs, tolerance) -> None:
        self.probes.append(version)

    def seen_probes(self) -> list:
        return self.probes

    def shutdown(self) -> None:
        pass


class Learner:
    """Publishes by setting each connected group's version; counts connections."""

    def __init__(self):
        self.lock = threading.RLock()
        self.updates = 0
        self.connections = []

    def connect_rollout(self, workers, bucket_bytes, transport, timeout_s=600.0):
        self.connections.append(list(workers))

    def publish(self, version):
        with self.lock:
            ray.get([w.receive.remote(version) for w in self.connections[-1]])
            return {"committed": True, "errors": []}


class Fleet(RolloutFleet):
    def _start(self, g, stale):
        return Engine.remote(stale)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _fleet(groups: int):
    fleet = Fleet(RolloutConfig(model="unused"), num_groups=groups)
    learner = Learner()
    fleet.attach(learner, bucket_bytes=1 << 20, transport="gloo")
    fleet.expect_probe(1, [[1, 2]], [[-0.5]], 0.05)
    assert fleet.publish(1)["committed"]
    return fleet, learner


def _prompts(k):
    return [[10 + i, 11] for i in range(k)], [{"round": 1, "i": i} for i in range(k)]


def test_single_group_is_refitted_before_its_requests_are_retried(ray_local):
    fleet, learner = _fleet(1)
    old = fleet.workers[0]
    ray.get(old.arm_death.remote())
    prompts, extra = _prompts(4)
    samples = fleet.generate(prompts, n=2, sampling={"seed": 5}, extra=extra)
    assert fleet.workers[0] is not old
    assert [s.extra["i"] for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # caller's order kept
    assert {v for s in samples for v in s.policy_versions} == {1}  # never the restarted engine's disk weights
    assert fleet.counters() == {"system/engine_restarts": 1.0, "system/requests_retried": 4.0,
                                "system/stale_rollout_groups": 0.0, "system/rollout_partitions": 0.0,
                                "system/unreachable_rollout_groups": 0.0}
    assert learner.connections[-1] == [fleet.workers[0]]  # publication group formed anew with it
    assert ray.get(fleet.workers[0].seen_probes.remote()) == [1]  # its refit check had the probe
    fleet.shutdown()


def test_other_group_serves_meanwhile_and_no_refit_past_a_learner_update(ray_local):
    fleet, learner = _fleet(2)
    ray.get(fleet.workers[0].arm_death.remote())
    prompts, extra = _prompts(4)
    with learner.lock:  # the learner stepped since version 1 was published: a refit must wait
        learner.updates += 1
    samples = fleet.generate(prompts, n=1, sampling={"seed": 5}, extra=extra)
    assert {v for s in samples for v in s.policy_versions} == {1}  # all from group 1
    assert fleet.state[0] == STALE and not fleet.refit()
    assert ray.get(fleet.workers[0].policy_version.remote()) is None
    assert fleet.publish(2)["committed"]  # the next publication refits it
    assert fleet.state == ["serving", "serving"]
    samples = fleet.generate(prompts, n=1, sampling={"seed": 6}, extra=extra)
    assert {v for s in samples for v in s.policy_versions} == {2}
    fleet.shutdown()


def test_engine_that_keeps_dying_ends_the_round_with_a_reason(ray_local):
    fleet, _ = _fleet(1)
    fleet.max_restarts = 0
    ray.get(fleet.workers[0].arm_death.remote())
    prompts, extra = _prompts(2)
    with pytest.raises(RuntimeError, match="rollout group 0 died again after 0 restarts"):
        fleet.generate(prompts, n=1, sampling={}, extra=extra)
