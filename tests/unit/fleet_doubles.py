"""Test doubles for the real RolloutFleet: Ray actors standing in for vLLM engines, and a learner.

    from tests.unit.fleet_doubles import EngineDouble, attached_fleet, fleet_of, policy_of, ray_local  # noqa: F401

    @ray.remote(num_cpus=0, max_restarts=0)
    class Engine(EngineDouble):
        def _inject(self, method):   # the test's own failure, at the start of `generate` / `receive_weights`
            ...

An EngineDouble serves samples labelled with its group (their one response token) and the version it
holds (None: a restarted, stale engine, which refuses to generate), records the refit probes it was given,
and sets its version on `receive_weights`.  LearnerDouble publishes as WeightPublisher does: to the groups it
was last connected to, waiting for each group's answer with the real `group_answers`.  The real
Policy (train/policy.py) publishes through it (policy_of).  Each test
keeps its injected failure (`_inject`) to itself.
"""

from __future__ import annotations

import threading

import pytest
import ray

from megatron_rl.publish.transports import group_answers
from megatron_rl.rollout.fleet import RolloutFleet
from megatron_rl.rollout.sample import RolloutSample


class EngineDouble:
    """Subclass it under @ray.remote(num_cpus=0, max_restarts=0) with the test's `_inject`."""

    def __init__(self, g: int, stale: bool = False):
        self.g, self.version, self.probes = g, None if stale else 0, []

    def _inject(self, method: str) -> None:
        """The injected failure, called at the start of `generate` and `receive_weights`."""

    def generate(self, prompts, sampling, n, info):
        self._inject("generate")
        if self.version is None:
            raise RuntimeError("this rollout group holds no complete policy version (restarted)")
        return [RolloutSample(prompt_tokens=list(p), response_tokens=[self.g], behavior_logprobs=[0.0],
                              policy_versions=[self.version], sampling=dict(sampling), finish_reason="stop",
                              started_at=0.0, finished_at=0.0, prompt=about)
                for p, about in zip(prompts, info) for _ in range(n)]

    def policy_version(self):
        return self.version

    def engine_alive(self) -> bool:
        return True

    def receive_weights(self, version: int) -> dict:
        self._inject("receive_weights")
        self.version = version
        return {"committed": True, "version": version, "error": None}

    def expect_probe(self, version, sequences, logprobs, tolerance) -> None:
        self.probes.append(version)

    def seen_probes(self) -> list:
        return self.probes

    def shutdown(self) -> None:
        pass


class LearnerDouble:
    """Publishes to the connected groups and waits for their answers as WeightPublisher does."""

    def __init__(self):
        self.lock = threading.RLock()
        self.updates = 0
        self.connections = []
        self.timeouts = []

    def connect_rollout(self, workers, settings):
        self.connections.append(list(workers))
        self.timeouts.append(settings.timeout_s)

    def publish(self, version):
        refs = [w.receive_weights.remote(version) for w in self.connections[-1]]
        results = group_answers(refs, version, self.timeouts[-1])
        return {"committed": all(r["committed"] for r in results),
                "errors": [r["error"] for r in results if not r["committed"]],
                "groups": [{"committed": r["committed"], "unresponsive": bool(r.get("unresponsive")),
                            "error": r["error"]} for r in results]}


def fleet_of(engine_cls) -> type:
    """A RolloutFleet whose groups are `engine_cls` actors (started with the group index and staleness)."""

    class Fleet(RolloutFleet):
        def _start(self, g, stale):
            return engine_cls.remote(g, stale)

    return Fleet


def policy_of(learner, fleet):
    """The real Policy over `learner` (a double) and `fleet`; no refit probe of its own (tests give it)."""
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner.config import SamplingConfig
    from megatron_rl.ranks.weights import PublishSettings
    from megatron_rl.train.policy import Policy, PolicySettings

    settings = PolicySettings(loss=GRPOLossConfig(), sampling=SamplingConfig(), micro_batch_size=1, probe_rows=1,
                              refit_tolerance=None, vocab_size=8, pad_id=0)
    return Policy(learner, fleet, settings, PublishSettings(timeout_s=fleet.cfg.publish_timeout_s))


def publish(policy, version: int) -> dict:
    """Publish `version` through the policy; the learner's report of it."""
    policy.publish(version)
    return policy.last_publication


def attached_fleet(fleet_cls, cfg, num_groups: int) -> tuple:
    """(fleet, learner, policy): `num_groups` groups published to by a Policy over a LearnerDouble,
    version 1 published with a probe."""
    fleet = fleet_cls(cfg, num_groups=num_groups)
    learner = LearnerDouble()
    policy = policy_of(learner, fleet)
    fleet.expect_probe(1, [[1, 2]], [[-0.5]], 0.05)
    assert publish(policy, 1)["committed"]
    return fleet, learner, policy


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
