"""A streaming engine's occupancy: requests in flight over time against its capacity (rollout/occupancy.py),
and the learner's idle fraction of a step (reporting/telemetry.py).

    python -m pytest tests/unit/test_occupancy.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.rollout.occupancy import Occupancy
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.reporting.telemetry import Telemetry

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_occupancy_is_time_weighted_and_capped_at_capacity():
    clock = Clock()
    occ = Occupancy(capacity=4, clock=clock)
    clock.now += 1.0                 # 1 s idle
    occ.change(2)
    clock.now += 2.0                 # 2 s at 2 of 4
    occ.change(8)
    clock.now += 1.0                 # 1 s full (8 in flight, 4 run: the rest wait in vLLM's queue)
    occ.change(0)
    clock.now += 1.0                 # 1 s idle
    got = occ.take()
    assert got["seconds"] == pytest.approx(5.0)
    assert got["occupancy"] == pytest.approx((2 * 2 + 4 * 1) / (4 * 5.0))
    assert got["idle_fraction"] == pytest.approx(2.0 / 5.0)


def test_each_take_starts_a_new_window():
    clock = Clock()
    occ = Occupancy(capacity=2, clock=clock)
    occ.change(2)
    clock.now += 3.0
    assert occ.take()["occupancy"] == pytest.approx(1.0)
    occ.change(1)
    clock.now += 2.0
    second = occ.take()
    assert second["seconds"] == pytest.approx(2.0) and second["occupancy"] == pytest.approx(0.5)
    assert second["idle_fraction"] == 0.0
    assert occ.take() == {"occupancy": 0.0, "idle_fraction": 0.0, "seconds": 0.0}  # an empty window


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        Occupancy(capacity=0)


def test_engine_and_learner_idle_fractions_reach_the_step_metrics():
    sample = RolloutSample(prompt_tokens=[1], response_tokens=[5, 6], behavior_logprobs=[-1.0, -1.0],
                           policy_versions=[0, 0], sampling={}, finish_reason="stop", started_at=0.0, finished_at=1.0)
    phases = {"rollout": 3.0, "score": 0.1, "learn": 1.0, "step": 4.0}
    out = Telemetry().step_metrics([sample], [], [], {}, phases, {}, {}, sampling={
        "system/engine_occupancy": 0.7, "system/engine_idle_fraction": 0.1, "system/unrelated": 1.0})
    assert out["system/learner_idle_fraction"] == pytest.approx(0.75)
    assert out["system/engine_occupancy"] == 0.7 and out["system/engine_idle_fraction"] == 0.1
    assert "system/unrelated" not in out


def test_a_scheduler_fed_occupancy_counts_what_ran_not_what_was_admitted():
    """Fed by vLLM's stat logger (RunningFeed), admissions no longer count; a refit's pause reads 0."""
    from types import SimpleNamespace

    from megatron_rl.rollout.occupancy import RunningFeed

    clock = Clock()
    occ = Occupancy(capacity=4, clock=clock)
    feed = RunningFeed()
    logger = feed.factory()(vllm_config=None, engine_index=0)
    logger.record(SimpleNamespace(num_running_reqs=4), None)  # before attach: dropped
    feed.attach(occ)
    occ.change(4)                                  # 4 admitted (StreamEngine.generate): not what runs
    logger.record(SimpleNamespace(num_running_reqs=2), None)
    clock.now += 1.0                               # 1 s at 2 of 4
    logger.record(None, None)                      # a record without scheduler stats changes nothing
    occ.paused()
    clock.now += 1.0                               # 1 s paused: nothing runs
    logger.record(SimpleNamespace(num_running_reqs=4), None)
    clock.now += 2.0                               # 2 s full
    got = occ.take()
    assert occ.source == "scheduler"
    assert got["occupancy"] == pytest.approx((2 * 1 + 4 * 2) / (4 * 4.0))
    assert got["idle_fraction"] == pytest.approx(1.0 / 4.0)


def test_an_occupancy_without_a_feed_counts_admitted_requests_and_ignores_pauses():
    clock = Clock()
    occ = Occupancy(capacity=2, clock=clock)
    occ.change(2)
    occ.paused()                                   # the admitted requests are still in flight
    occ.change(0, source="scheduler")              # not this occupancy's source
    clock.now += 1.0
    assert occ.take()["occupancy"] == pytest.approx(1.0)
