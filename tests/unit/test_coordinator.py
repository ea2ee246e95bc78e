"""TrajectoryQueue rules without Ray and without a WAL: admission, TTL, windows, idempotency,
quotas, priority sampling, backpressure, metrics.

    python -m pytest tests/unit/test_coordinator.py -q
"""

import dataclasses

import numpy as np
import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit
TOK = "e" * 64


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def traj(i, versions=0, prompt=None, source="", priority=1.0, status="ok"):
    r = 3 if np.ndim(versions) == 0 else len(versions)
    extra = {"error_code": "timeout"} if status != "ok" else {}
    return make_trajectory(id=f"t{i}", prompt_id=prompt or f"p{i}", dataset_version="d", policy_versions=versions,
                           tokenizer_hash=TOK, prompt_tokens=[1, 2], response_tokens=[3] * r,
                           behavior_logprobs=[-1.0] * r, reward_components={} if status != "ok" else {"r": 1.0},
                           grader_version="g", terminal_reason="eos", rollout_started_at=0.0, scored_at=0.0,
                           source=source, priority=priority, status=status, **extra)


def queue(clock=None, **cfg):
    return TrajectoryQueue(CoordinatorConfig(**cfg), tokenizer_hash=TOK, clock=clock or Clock())


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("max_staleness", -1), ("max_version_lag", -2),
                                         ("max_age_s", -1.0), ("lease_ttl_s", 0), ("sampling", "lifo"),
                                         ("backpressure_reaction", "panic"), ("wal_synchronous", "OFF"),
                                         ("take_replay_window", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"coordinator.{field}"):
        CoordinatorConfig(**{field: value})


def test_config_from_yaml_dict_rejects_unknown_key():
    assert from_dict(CoordinatorConfig, {"batch_size": 8}).batch_size == 8
    with pytest.raises(ConfigError, match="batchsize"):
        from_dict(CoordinatorConfig, {"batchsize": 8})


def test_admission_rule_bounds_staleness():
    q = queue(batch_size=4, max_staleness=1)  # capacity (1 + 0 + 1) * 4 = 8
    leases = q.try_admit(10)
    assert len(leases) == 8 and q.try_admit(1) == []
    q.release(leases[:2])  # two rollouts abandoned
    assert len(q.try_admit(5)) == 2
    q.put_many([traj(i) for i in range(4)], lease_ids=leases[2:6])
    assert len(q.take(4)) == 4
    assert q.try_admit(1) == []  # consumed 4 + running 4 = 8: still full at version 0
    q.set_version(1)  # (1 + 1 + 1) * 4 - 8 = 4
    assert len(q.try_admit(9)) == 4
    assert q.metrics()["queue/running"] == 8


def test_dropped_trajectories_free_admission_slots_and_leases_expire():
    clock = Clock()
    q = queue(clock, batch_size=2, max_staleness=0, lease_ttl_s=10, max_version_lag=0)
    leases = q.try_admit(2)
    q.put_many([traj(0), traj(1)], lease_ids=leases)
    assert q.try_admit(1) == []
    q.set_version(1)  # both now lag 1 > 0: dropped; capacity (0 + 1 + 1) * 2 - 0 = 4
    assert q.metrics()["queue/dropped/version_lag"] == 2
    assert len(q.try_admit(4)) == 4
    clock.now += 11  # the four rollouts never report back
    assert len(q.try_admit(4)) == 4
    assert q.metrics()["queue/leases_expired"] == 4


def test_admission_wait_is_measured():
    clock = Clock()
    q = queue(clock, batch_size=1, max_staleness=0)
    assert len(q.try_admit(1, worker="w")) == 1
    assert q.try_admit(1, worker="w") == []
    clock.now += 5.0
    assert q.try_admit(1, worker="w") == []
    q.set_version(1)
    assert len(q.try_admit(1, worker="w")) == 1
    m = q.metrics()
    # two grants: the first waited 0 s, the second 5 s (from its first refusal)
    assert m["queue/admission_wait_s_p50"] == pytest.approx(2.5)
    assert 4.9 < m["queue/admission_wait_s_p99"] <= 5.0


def test_version_ttl_uses_oldest_token_version():
    q = queue(max_version_lag=1, max_staleness=5)
    q.set_version(2)
    res = q.put_many([traj(0, versions=[0, 2, 2]), traj(1, versions=[1, 2, 2]), traj(2, versions=[2, 2, 2])])
    assert res.dropped == {"t0": "version_lag"} and res.accepted == ["t1", "t2"]
    q.set_version(3)
    assert q.queued_ids() == ["t2"] and q.outcome("t1") == "dropped/version_lag"
    assert q.metrics()["queue/dropped/version_lag"] == 2


def test_wall_clock_ttl():
    clock = Clock()
    q = queue(clock, max_age_s=60)
    q.put(traj(0))
    clock.now += 30
    q.put(traj(1))
    clock.now += 31  # t0 is 61 s old, t1 31 s
    assert [t.id for t in q.take(5)] == ["t1"]
    assert q.outcome("t0") == "dropped/max_age"


def test_take_returns_only_the_version_window():
    q = queue(max_version_lag=3, max_staleness=5)
    q.set_version(3)
    q.put_many([traj(0, 0), traj(1, 1), traj(2, [1, 2, 2]), traj(3, 2), traj(4, 3)])
    assert [t.id for t in q.take(10, min_version=1, max_version=1)] == ["t1"]
    assert [t.id for t in q.take(10, min_version=2)] == ["t3", "t4"]
    assert [t.id for t in q.take(10)] == ["t0", "t2"]  # default window [3 - 3, 3]
    with pytest.raises(ValueError, match="empty version window"):
        q.take(1, min_version=3, max_version=2)


def test_ids_are_idempotent_and_consumed_exactly_once():
    q = queue()
    assert q.put_many([traj(0), traj(1), traj(0)]).duplicates == ["t0"]
    assert q.put(traj(1)).duplicates == ["t1"]
    assert [t.id for t in q.take(5)] == ["t0", "t1"]
    assert q.put(traj(0)).duplicates == ["t0"]  # consumed ids stay known
    assert q.take(5) == [] and q.metrics()["queue/duplicates"] == 3
    assert q.metrics()["queue/consumed"] == 2


def test_take_with_request_id_replays_the_same_batch():
    q = queue()
    q.put_many([traj(i) for i in range(6)])
    first = q.take(2, request_id="step-1")
    assert [t.id for t in q.take(2, request_id="step-1")] == [t.id for t in first] == ["t0", "t1"]
    assert [t.id for t in q.take(2, request_id="step-2")] == ["t2", "t3"]
    assert len(q) == 2 and q.metrics()["queue/consumed"] == 4
    assert q.take(2, request_id="step-3", min_version=5, max_version=5) == []  # nothing consumed ...
    assert [t.id for t in q.take(2, request_id="step-3")] == ["t4", "t5"]  # ... so a retry takes afresh


def test_rejections_are_counted_and_returned_not_stored():
    q = queue()
    good = traj(0)
    bad_sum = dataclasses.replace(traj(1), response_tokens=np.array([9, 9, 9], np.int32))
    bad_tok = make_trajectory(**{**{f.name: getattr(traj(2), f.name) for f in dataclasses.fields(good)
                                    if f.name not in ("checksum", "sampling_probability")}, "tokenizer_hash": "x"})
    res = q.put_many([good, bad_sum, bad_tok, "not a trajectory"])
    assert res.accepted == ["t0"]
    assert res.rejected["t1"].startswith("checksum") and res.rejected["t2"].startswith("tokenizer")
    assert res.rejected["None"].startswith("schema")
    m = q.metrics()
    assert (m["queue/rejected/checksum"], m["queue/rejected/tokenizer"], m["queue/rejected/schema"]) == (1, 1, 1)
    assert q.queued_ids() == ["t0"] and q.outcome("t1") is None


def test_verifier_timeouts_are_counted_and_flagged():
    q = queue()
    q.put_many([traj(0), traj(1, status="verifier_timeout")])
    batch = q.take(2)
    assert [t.in_loss for t in batch] == [True, False] and batch[1].reward is None
    assert q.metrics()["queue/status/verifier_timeout"] == 1


def test_quotas_per_prompt_and_source():
    q = queue(max_queued_per_prompt=2, max_queued_per_source=3)
    res = q.put_many([traj(i, prompt="pA", source="math") for i in range(3)] + [traj(3, prompt="pB", source="math"),
                                                                              traj(4, prompt="pC", source="math"),
                                                                              traj(5, prompt="pC", source="code")])
    assert res.dropped == {"t2": "quota_prompt", "t4": "quota_source"}
    assert res.accepted == ["t0", "t1", "t3", "t5"]
    q.take(1)  # frees one "math" slot
    assert q.put(traj(6, prompt="pD", source="math")).accepted == ["t6"]


def test_priority_sampling_stores_probability():
    q = queue(sampling="priority", seed=1)
    q.put_many([traj(0, priority=8.0)] + [traj(i, priority=1.0) for i in range(1, 9)])  # weights 8 of 16
    batch = q.take(1)
    assert batch[0].id == "t0" or batch[0].sampling_probability == pytest.approx(1 / 16)
    if batch[0].id == "t0":
        assert batch[0].sampling_probability == pytest.approx(0.5)
    assert batch[0].compute_checksum() == batch[0].checksum  # probability is outside the checksum
    hits = 0
    for seed in range(40):
        q = queue(sampling="priority", seed=seed)
        q.put_many([traj(0, priority=8.0)] + [traj(i, priority=1.0) for i in range(1, 9)])
        hits += q.take(1)[0].id == "t0"
    assert hits > 10  # p = 0.5 per draw; uniform sampling would give ~4 of 40


def test_backpressure_signal_throttles_admission():
    q = queue(batch_size=2, max_staleness=3, max_version_lag=3, backpressure_dv_p95=1.0)
    q.put_many([traj(i, 0) for i in range(2)])
    q.set_version(2)  # queued lag 2 > 1
    bp = q.backpressure()
    assert bp.active and bp.reasons == ["dv_p95"] and bp.dv_p95 == 2
    assert len(q.try_admit(100)) == (0 + 2 + 1) * 2 - 2  # as if max_staleness were 0
    report = queue(batch_size=2, max_staleness=3, max_version_lag=3, backpressure_dv_p95=1.0,
                   backpressure_reaction="report")
    report.put_many([traj(i, 0) for i in range(2)])
    report.set_version(2)
    assert len(report.try_admit(100)) == (3 + 2 + 1) * 2 - 2
    assert report.metrics()["queue/backpressure"] == 1.0


def test_starving_and_metric_keys():
    clock = Clock()
    q = queue(clock)
    q.put_many([traj(i) for i in range(3)])
    clock.now += 4
    q.set_version(1)
    m = q.metrics()
    assert all(k.startswith("queue/") for k in m)
    assert m["queue/depth"] == 3 and m["queue/age_s_p50"] == pytest.approx(4) and m["queue/dv_p95"] == 1
    assert q.take(8) and q.backpressure().starving and q.metrics()["queue/starving"] == 1.0


def test_learner_lag_report_throttles_admission_until_it_recovers():
    """Backpressure from the learner's reported dv P95 / D_lag P95: eta drops to 0 (one round
    ahead of the version at most) and comes back when the report falls under the limit."""
    q = queue(batch_size=2, max_staleness=2, max_version_lag=2, backpressure_taken_dv_p95=1.0,
              backpressure_d_lag_p95=0.05)
    assert q.metrics()["queue/admission_eta"] == 2
    q.report_lag(dv_p95=1.0, d_lag_p95=0.01)  # at the limits: not past them
    assert not q.backpressure().active
    q.report_lag(dv_p95=0.0, d_lag_p95=0.2)
    bp = q.backpressure()
    assert bp.active and bp.reasons == ["d_lag_p95"]
    m = q.metrics()
    assert m["queue/backpressure"] == 1 and m["queue/backpressure_d_lag"] == 1 and m["queue/admission_eta"] == 0
    assert len(q.try_admit(100)) == (0 + 0 + 1) * 2  # as if max_staleness were 0
    q.report_lag(dv_p95=2.0, d_lag_p95=None)
    assert q.backpressure().reasons == ["taken_dv_p95"] and q.try_admit(100) == []
    q.report_lag(dv_p95=0.0, d_lag_p95=0.0)
    assert len(q.try_admit(100)) == (2 + 0 + 1) * 2 - 2  # max_staleness again
    off = queue(batch_size=2, max_staleness=2, max_version_lag=2)  # limits default to off
    off.report_lag(dv_p95=5.0, d_lag_p95=9.0)
    assert not off.backpressure().active and len(off.try_admit(100)) == 6


def test_lag_report_survives_a_restart(tmp_path):
    cfg = dict(batch_size=2, max_staleness=2, max_version_lag=2, backpressure_d_lag_p95=0.05,
               wal_path=str(tmp_path / "q.db"))
    q = queue(**cfg)
    q.report_lag(dv_p95=0.0, d_lag_p95=0.3)
    q.close()
    again = queue(**cfg)
    assert again.backpressure().reasons == ["d_lag_p95"] and len(again.try_admit(100)) == 2


@pytest.mark.parametrize("name", ["backpressure_taken_dv_p95", "backpressure_d_lag_p95"])
def test_learner_backpressure_limits_are_checked(name):
    with pytest.raises(ValueError, match=f"coordinator.{name}"):
        CoordinatorConfig(**{name: -1.0})
