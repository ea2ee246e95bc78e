"""A rollout group that stops answering is left out until it answers again, then refitted before it serves.

    python -m pytest tests/unit/test_fleet_partition.py -q

The real RolloutFleet (megatron_rl/rollout/fleet.py) and the real per-group wait of a publication
(publish/transports.py `group_answers`) over Ray actors standing in for vLLM engines.  The injected
failure is a group that stops answering: its actor blocks for some seconds inside a call (as a
SIGSTOPped process would; an actor runs one call at a time, so every later call waits too).  What
must hold: the publication gives up on it after rollout.publish_timeout_s and the other group holds
the version; a generate call past rollout.generate_timeout_s is sent to the other group; no sample
comes from the stopped group meanwhile; the publication group is formed without it, and with it again
once it answers, when it is refitted (the last version, its probe) before it serves.
"""

from __future__ import annotations

import time

import pytest
import ray

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.fleet import SERVING, STALE
from megatron_rl.rollout.sample import PromptInfo
from tests.unit.fleet_doubles import EngineDouble, attached_fleet, fleet_of, publish, ray_local  # noqa: F401

pytestmark = pytest.mark.unit

TIMEOUT_S = 1.5  # rollout.publish_timeout_s and generate_timeout_s here
STOP_S = 5.0  # how long the stopped group blocks: longer than the timeouts


@ray.remote(num_cpus=0, max_restarts=0)
class Engine(EngineDouble):
    def __init__(self, g: int, stale: bool = False):
        super().__init__(g, stale)
        self.stop_in = None

    def stop_in_next(self, method: str) -> None:
        self.stop_in = method

    def _inject(self, method: str) -> None:
        if self.stop_in == method:
            self.stop_in = None
            time.sleep(STOP_S)  # the injected failure: nothing answers meanwhile


@pytest.fixture
def fleet(ray_local):
    cfg = RolloutConfig(model="unused", publish_timeout_s=TIMEOUT_S, generate_timeout_s=TIMEOUT_S)
    fleet, learner, policy = attached_fleet(fleet_of(Engine), cfg, num_groups=2)
    assert learner.timeouts == [TIMEOUT_S]  # rollout.publish_timeout_s reaches the publisher
    yield fleet, learner, policy
    fleet.shutdown()


def _generate(fleet, k=4, seed=5):
    prompts, info = [[10 + i, 11] for i in range(k)], [PromptInfo(id=str(i)) for i in range(k)]
    samples = fleet.generate(prompts, n=1, sampling={"seed": seed}, info=info)
    assert [s.prompt.id for s in samples] == [str(i) for i in range(k)]  # every request answered, in order
    return samples


def _wait_back(fleet, deadline_s=STOP_S + 5):
    end = time.monotonic() + deadline_s
    while fleet.unreachable and time.monotonic() < end:
        fleet.check_returned()
        time.sleep(0.2)
    assert not fleet.unreachable


def test_publication_gives_up_on_a_stopped_group_and_refits_it_when_it_answers(fleet):
    fleet, learner, policy = fleet
    stopped = fleet.workers[1]
    ray.get(stopped.stop_in_next.remote("receive_weights"))
    t0 = time.monotonic()
    report = publish(policy, 2)
    assert time.monotonic() - t0 < STOP_S  # the publication did not wait for it
    assert report["committed"]  # the group that answered holds version 2
    assert fleet.unreachable.keys() == {1} and fleet.state == [SERVING, STALE]
    assert fleet.counters()["system/rollout_partitions"] == 1.0
    # The other group goes on: every sample of version 2, none from the stopped group.
    assert {(s.response_tokens[0], s.policy_versions[0]) for s in _generate(fleet)} == {(0, 2)}
    fleet.expect_probe(3, [[1, 2]], [[-0.5]], 0.05)
    assert publish(policy, 3)["committed"]
    assert learner.connections[-1] == [fleet.workers[0]]  # publication group formed without it
    assert ray.get(fleet.workers[0].seen_probes.remote()) == [1, 3]
    _wait_back(fleet)
    samples = _generate(fleet, seed=6)  # submit sees it back: refit (version 3, probe) before serving
    assert learner.connections[-1] == fleet.workers  # formed with it again
    assert fleet.state == [SERVING, SERVING]
    assert ray.get(stopped.policy_version.remote()) == 3 and ray.get(stopped.seen_probes.remote()) == [1, 3]
    assert {v for s in samples for v in s.policy_versions} == {3}
    assert fleet.counters()["system/unreachable_rollout_groups"] == 0.0


def test_generate_past_its_timeout_goes_to_the_other_group(fleet):
    fleet, learner, policy = fleet
    ray.get(fleet.workers[0].stop_in_next.remote("generate"))
    samples = _generate(fleet)
    assert {(s.response_tokens[0], s.policy_versions[0]) for s in samples} == {(1, 1)}
    assert fleet.unreachable.keys() == {0}
    assert fleet.counters()["system/requests_retried"] == 2.0  # group 0's share of the 4 prompts
    with learner.lock:  # the learner moved on: no refit of version 1 once it is back
        learner.updates += 1
    _wait_back(fleet)
    _generate(fleet, seed=7)
    assert fleet.state == [STALE, SERVING]
    assert publish(policy, 2)["committed"]  # the next publication refits it
    assert learner.connections[-1] == fleet.workers and fleet.state == [SERVING, SERVING]
    assert {(s.response_tokens[0], s.policy_versions[0]) for s in _generate(fleet, seed=8)} == {(0, 2), (1, 2)}
