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

import pytest
import ray

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet import SERVING, STALE
from megatron_rl.rollout.sample import PromptInfo
from tests.unit.fleet_doubles import (EngineDouble, LearnerDouble, attached_fleet, fleet_of, policy_of,  # noqa: F401
                                      publish, ray_local)

pytestmark = pytest.mark.unit


@ray.remote(num_cpus=0, max_restarts=0)
class Engine(EngineDouble):
    def __init__(self, g: int, stale: bool = False):
        super().__init__(g, stale)
        self.dies = False

    def arm_death(self) -> None:
        self.dies = True

    def _inject(self, method: str) -> None:
        if method == "generate" and self.dies:
            os._exit(1)  # the injected failure: the engine process is gone mid-call


def _fleet(groups: int):
    return attached_fleet(fleet_of(Engine), RolloutConfig(model="unused"), num_groups=groups)


def _prompts(k):
    return [[10 + i, 11] for i in range(k)], [PromptInfo(id=str(i), round=1) for i in range(k)]


def test_single_group_is_refitted_before_its_requests_are_retried(ray_local):
    fleet, learner, _ = _fleet(1)
    old = fleet.workers[0]
    ray.get(old.arm_death.remote())
    prompts, info = _prompts(4)
    samples = fleet.generate(prompts, n=2, sampling={"seed": 5}, info=info)
    assert fleet.workers[0] is not old
    assert [s.prompt.id for s in samples] == ["0", "0", "1", "1", "2", "2", "3", "3"]  # caller's order kept
    assert {v for s in samples for v in s.policy_versions} == {1}  # never the restarted engine's disk weights
    assert fleet.counters() == {"system/engine_restarts": 1.0, "system/requests_retried": 4.0,
                                "system/stale_rollout_groups": 0.0, "system/rollout_partitions": 0.0,
                                "system/unreachable_rollout_groups": 0.0}
    assert learner.connections[-1] == [fleet.workers[0]]  # publication group formed anew with it
    assert ray.get(fleet.workers[0].seen_probes.remote()) == [1]  # its refit check had the probe
    fleet.shutdown()


def test_other_group_serves_meanwhile_and_no_refit_past_a_learner_update(ray_local):
    fleet, learner, policy = _fleet(2)
    ray.get(fleet.workers[0].arm_death.remote())
    prompts, info = _prompts(4)
    with learner.lock:  # the learner stepped since version 1 was published: a refit must wait
        learner.updates += 1
    samples = fleet.generate(prompts, n=1, sampling={"seed": 5}, info=info)
    assert {v for s in samples for v in s.policy_versions} == {1}  # all from group 1
    assert fleet.state[0] == STALE and not fleet.refit()
    assert ray.get(fleet.workers[0].policy_version.remote()) is None
    assert publish(policy, 2)["committed"]  # the next publication refits it
    assert fleet.state == ["serving", "serving"]
    samples = fleet.generate(prompts, n=1, sampling={"seed": 6}, info=info)
    assert {v for s in samples for v in s.policy_versions} == {2}
    fleet.shutdown()


def test_engine_that_keeps_dying_ends_the_round_with_a_reason(ray_local):
    fleet, _, _ = _fleet(1)
    fleet.max_restarts = 0
    ray.get(fleet.workers[0].arm_death.remote())
    prompts, info = _prompts(2)
    with pytest.raises(RuntimeError, match="rollout group 0 died again after 0 restarts"):
        fleet.generate(prompts, n=1, sampling={}, info=info)


@ray.remote(num_cpus=0, max_restarts=0)
class DiesInPublication(EngineDouble):
    """Its vLLM engine dies while a publication is being received (the actor itself still answers)."""

    def __init__(self, g: int, stale: bool = False):
        super().__init__(g, stale)
        self.armed = self.dead = False

    def arm_death(self) -> None:
        self.armed = True

    def _inject(self, method: str) -> None:
        if method == "receive_weights" and self.armed:
            self.armed, self.dead = False, True
            raise RuntimeError("[gloo] Connection closed by peer")

    def engine_alive(self) -> bool:
        return not self.dead


class SendBreaksOff(LearnerDouble):
    """Raises when a group failed, as the gloo transport does when a peer's link broke mid-send."""

    def publish(self, version):
        report = super().publish(version)
        if not report["committed"]:
            raise RuntimeError(f"publication broke off: {report['errors'][0]}")
        return report


def test_an_engine_that_dies_during_publication_is_restarted_and_refitted(ray_local):
    """Issue 30 defect 6: the same restart path as a death during generation, not a traceback."""
    fleet = fleet_of(DiesInPublication)(RolloutConfig(model="unused"), num_groups=2)
    learner = SendBreaksOff()
    policy = policy_of(learner, fleet)
    assert publish(policy, 1)["committed"]
    old = fleet.workers[1]
    ray.get(old.arm_death.remote())
    assert publish(policy, 2)["committed"]
    assert fleet.workers[1] is not old and fleet.state == [SERVING, SERVING]
    assert ray.get([w.policy_version.remote() for w in fleet.workers]) == [2, 2]
    assert learner.connections[-1] == fleet.workers  # the publication group formed anew with the new engine
    assert fleet.counters()["system/engine_restarts"] == 1.0
    fleet.shutdown()


def test_a_request_waiting_for_a_serving_group_ends_when_the_fleet_shuts_down(ray_local):
    # A run that fails while a restarted group waits for its refit must not wait out rollout.refit_timeout_s
    # (600 s) before its process can exit: shutdown ends the wait.
    import threading
    import time

    from megatron_rl.rollout.fleet import RolloutFailed

    fleet, _, _ = _fleet(1)
    with fleet._lock:
        fleet.state[0] = STALE  # restarted, not refitted yet
    fleet.set_refitter(lambda wait_s: False)  # the learner is busy: no refit now
    prompts, info = _prompts(1)
    outcome = []

    def generate():
        try:
            fleet.generate(prompts, n=1, sampling={"seed": 1}, info=info)
        except RolloutFailed as err:
            outcome.append(str(err))

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(1.0)
    assert t.is_alive()  # waiting for a serving group
    t0 = time.monotonic()
    fleet.shutdown()
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert outcome == ["the rollout fleet was shut down"]
