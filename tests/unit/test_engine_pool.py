"""The experiment runner's engine pool: what it keeps from a run, and what it hands to the next one.

    python -m pytest tests/unit/test_engine_pool.py -q

megatron_rl/train/engine_pool.py over a real local Ray (real placement groups) and the real
RolloutFleet, whose engines are Ray actors standing in for vLLM (as in test_fleet_restart.py: a
publication sets their version).  What must hold: a fleet whose groups all serve is parked and the
next fleet of the same engine identity gets the same actors back, reset to its config and stale until
its first publication; a stale group, sleep mode or another identity (vLLM arguments, model shapes)
is not handed over (the parked actor is ended); the placement group is kept for the same key and
removed for another; the runner's free-cluster check allows what the pool it is given holds.  The end-to-end
proof that a pooled run equals a cold one is tests/e2e/test_experiment_inprocess.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from types import SimpleNamespace

import pytest
import ray

from megatron_rl.experiment.inprocess import check_released
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_setup import engine_identity
from megatron_rl.rollout.fleet import SERVING, STALE, RolloutFleet
from megatron_rl.train.engine_pool import EnginePool, engine_pool
from tests.unit.fleet_doubles import policy_of

pytestmark = pytest.mark.unit

MODEL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2, "vocab_size": 64}


@ray.remote(num_cpus=0, max_restarts=0)
class Engine:
    def __init__(self):
        self.version, self.model = 0, None

    def reset(self, config: dict) -> None:
        self.version, self.model = None, config["model"]

    def policy_version(self):
        return self.version

    def receive(self, version: int) -> None:
        self.version = version

    def served_model(self):
        return self.model

    def shutdown(self) -> None:
        pass


class Learner:
    def __init__(self):
        self.lock, self.updates, self.workers = threading.RLock(), 0, []

    def connect_rollout(self, workers, settings):
        self.workers = list(workers)

    def publish(self, version):
        ray.get([w.receive.remote(version) for w in self.workers])
        return {"committed": True, "errors": [], "groups": [{"committed": True, "unresponsive": False,
                                                             "error": None} for _ in self.workers]}


class Fleet(RolloutFleet):
    def _start(self, g, stale):
        return Engine.remote()


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _model(tmp_path, name: str, **changes) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**MODEL, "_name_or_path": str(d), **changes}))
    return str(d)


def _cfg(placement="disaggregated", groups=1):
    return SimpleNamespace(run=SimpleNamespace(placement=placement),
                           rollout=SimpleNamespace(data_parallel_size=groups, tensor_parallel_size=1))


def test_engine_identity_is_shapes_and_engine_arguments_not_weights_or_sampling(tmp_path):
    a = RolloutConfig(model=_model(tmp_path, "a"), max_tokens=2, temperature=1.0)
    same_shapes = dataclasses.replace(a, model=_model(tmp_path, "b"), max_tokens=7, temperature=0.5,
                                      publish_timeout_s=5.0)
    assert engine_identity(a, False) == engine_identity(same_shapes, False)
    wider = dataclasses.replace(a, model=_model(tmp_path, "c", hidden_size=32))
    longer = dataclasses.replace(a, max_model_len=2048)
    other_kv = dataclasses.replace(a, kv_cache_gib=2)
    for other in (wider, longer, other_kv):
        assert engine_identity(other, False) != engine_identity(a, False)
    bound = dataclasses.replace(a, cpu_threads_bind="0")  # the same binding, the actor on other cores
    assert engine_identity(dataclasses.replace(bound, cpu_cores="0"), False) != engine_identity(bound, False)


def test_a_serving_fleet_is_handed_to_the_next_run_stale_until_published(ray_local, tmp_path):
    pool = EnginePool()
    place = pool.placement(_cfg(), learner_ranks=1)
    first = Fleet(RolloutConfig(model=_model(tmp_path, "run1")), num_groups=1, placement=place.rollout)
    actor = first.workers[0]
    assert pool.park(first) and first.workers == []  # the run's close then ends nothing of it
    assert pool.placement(_cfg(), learner_ranks=1) is place  # same key: the same placement group
    cfg2 = RolloutConfig(model=_model(tmp_path, "run2"), max_tokens=9)
    handed = pool.take_engines(cfg2)
    assert handed == [actor] and pool.handed == 1 and pool.workers is None
    second = Fleet(cfg2, num_groups=1, placement=place.rollout, handed_over=handed)
    assert second.state == [STALE] and ray.get(actor.served_model.remote()) == cfg2.model
    assert ray.get(actor.policy_version.remote()) is None  # serves nothing of the earlier run
    policy = policy_of(Learner(), second)
    policy.publish(0)
    assert policy.last_publication["committed"] and second.state == [SERVING]
    assert ray.get(actor.policy_version.remote()) == 0
    pool.drop()
    assert ray.util.placement_group_table(place.group)["state"] == "REMOVED"


def test_what_is_not_handed_over(ray_local, tmp_path):
    pool = EnginePool()
    place = pool.placement(_cfg(), learner_ranks=1)
    stale = Fleet(RolloutConfig(model=_model(tmp_path, "s")), num_groups=1, placement=place.rollout)
    stale.state[0] = STALE  # a group whose refit did not commit (injected)
    assert not pool.park(stale) and len(stale.workers) == 1
    asleep = Fleet(RolloutConfig(model=_model(tmp_path, "z"), sleep_mode=True), num_groups=1)
    assert not pool.park(asleep) and len(asleep.workers) == 1
    fleet = Fleet(RolloutConfig(model=_model(tmp_path, "a")), num_groups=1, placement=place.rollout)
    actor = fleet.workers[0]
    assert pool.park(fleet)
    assert pool.take_engines(RolloutConfig(model=_model(tmp_path, "wide", hidden_size=32))) is None
    assert _ended(actor)  # the parked actor that did not fit was ended
    other = pool.placement(_cfg(groups=2), learner_ranks=1)  # another key: a new placement group
    assert other is not place and ray.util.placement_group_table(place.group)["state"] == "REMOVED"
    pool.drop()
    stale.shutdown()
    asleep.shutdown()


def test_the_runner_allows_what_the_pool_it_is_given_holds(ray_local):
    with engine_pool() as pool:
        pool.placement(_cfg(), learner_ranks=1)
        assert pool.reserved()["CPU"] == pytest.approx(0.5)  # one learner bundle + one rollout bundle
        assert check_released(pool, timeout_s=30.0) is True  # returns once the earlier tests' actors ended
        assert check_released(None, timeout_s=0.5) is False  # the pool is passed, never found: without it, held
        with engine_pool() as other:  # no pool is global: another one is independent of the first
            assert other is not pool and other.place is None and pool.place is not None
    assert pool.place is None


def test_before_a_run_the_pool_ends_what_only_another_kind_of_run_uses(ray_local, tmp_path):
    pool = EnginePool()
    place = pool.placement(_cfg(), learner_ranks=1)
    fleet = Fleet(RolloutConfig(model=_model(tmp_path, "a")), num_groups=1, placement=place.rollout)
    engine = fleet.workers[0]
    assert pool.park(fleet)
    sft_learner = Engine.remote()  # stands in for an sft run's learner actor (only its life matters here)
    pool.free_learners = [sft_learner]
    pool.prepare_for("sft")  # an sft run: the train run's placement and engine end, its learners stay
    assert pool.place is None and pool.workers is None and pool.free_learners == [sft_learner]
    assert ray.util.placement_group_table(place.group)["state"] == "REMOVED"
    assert _ended(engine)
    assert ray.get(sft_learner.policy_version.remote(), timeout=30) == 0
    pool.prepare_for("train")  # a train run: the sft learners end
    assert pool.free_learners is None
    assert _ended(sft_learner)


def _ended(actor, within_s: float = 30.0) -> bool:
    """True once calls to `actor` fail because it is dead.  ray.kill is asynchronous: a call sent
    right after it may still be served, so the first answer alone proves nothing either way."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.policy_version.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False
