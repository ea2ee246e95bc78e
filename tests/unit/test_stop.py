"""Stop conditions (megatron_rl/reporting/stop.py): each rule fires on its metric, names itself,
carries its own exit code, stays quiet when off or under its bound, and validates its config.

    python -m pytest tests/unit/test_stop.py -q
"""

import json
import math
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.train.config import TrainConfig, load_train_config
from megatron_rl.reporting.stop import EXIT_CODES, StopConditionMet, StopConfig, StopRules

pytestmark = pytest.mark.unit

HEALTHY = {"numerics/nonfinite_loss": 0.0, "numerics/nonfinite_grad_norm": 0.0, "learn/loss": 0.1,
           "learn/grad_norm": 0.5, "learn/kl_ref_k2_grad_theta_ref": 0.01, "learn/entropy_estimate": 2.0,
           "learn/d_lag/p95": 1e-6, "latency/verifier_error_rate": 0.0}


def feed(rules, rows):
    for step, row in enumerate(rows, start=1):
        rules.observe(step, {**HEALTHY, **row})
    return rules.triggered


def test_exit_codes_are_distinct_and_avoid_requeue_and_bad_input():
    codes = list(EXIT_CODES.values())
    assert len(set(codes)) == len(codes)
    assert not {0, 1, 2, 75} & set(codes)


def test_healthy_history_never_stops_with_every_rule_on():
    cfg = StopConfig(dev_eval_drops=2, kl_max=1.0, entropy_min=0.5, entropy_max=5.0, d_lag_p95_max=0.1,
                     verifier_error_rate_max=0.2)
    assert feed(StopRules(cfg), [{}] * 20) is None


@pytest.mark.parametrize("key", ["numerics/nonfinite_loss", "numerics/nonfinite_grad_norm"])
def test_nonfinite_is_on_by_default(key):
    rules = StopRules(StopConfig())
    cond = feed(rules, [{}, {key: 1.0, "learn/loss": math.nan}])
    assert cond.name == "nonfinite" and cond.step == 2 and cond.exit_code == 81
    assert feed(StopRules(StopConfig(nonfinite=False)), [{key: 1.0}]) is None


def test_dev_eval_falling_twice_in_a_row():
    rules = StopRules(StopConfig(dev_eval_drops=2, dev_eval_metric="reward"))
    for step, value in ((0, 0.5), (2, 0.6), (4, 0.55), (6, 0.58), (8, 0.57)):  # falls, rises, falls once
        rules.observe(step, {"eval/dev_reward": value, "eval/dev_correctness": 0.0})
        assert rules.triggered is None, step
    rules.observe(10, {"eval/dev_reward": 0.40})
    cond = rules.triggered
    assert cond.name == "dev_eval_falling" and cond.step == 10 and cond.exit_code == 82
    assert cond.metric == "eval/dev_reward" and cond.value == pytest.approx(0.40)
    assert StopRules(StopConfig()).observe(10, {"eval/dev_correctness": 0.0}) is None  # off by default


def test_kl_above_bound_with_patience():
    rules = StopRules(StopConfig(kl_max=0.5, patience=2))
    k = "learn/kl_ref_k3_grad_ref_theta"
    assert feed(rules, [{k: 0.9}, {k: 0.1}, {k: 0.9}]) is None  # never two in a row
    rules.observe(4, {**HEALTHY, k: 0.8})
    cond = rules.triggered
    assert (cond.name, cond.step, cond.metric, cond.exit_code) == ("kl_out_of_bounds", 4, k, 83)
    assert "for 2 steps" in cond.describe()


@pytest.mark.parametrize("value,bound", [(0.1, "< 0.5"), (9.0, "> 5")])
def test_entropy_outside_bounds(value, bound):
    cond = feed(StopRules(StopConfig(entropy_min=0.5, entropy_max=5.0)), [{}, {"learn/entropy_estimate": value}])
    assert cond.name == "entropy_out_of_bounds" and cond.exit_code == 84 and cond.threshold == bound


def test_lag_p95_above_threshold():
    cond = feed(StopRules(StopConfig(d_lag_p95_max=0.05)), [{"learn/d_lag/p95": 0.01}, {"learn/d_lag/p95": 0.2}])
    assert cond.name == "lag_p95" and cond.step == 2 and cond.exit_code == 85 and cond.value == 0.2


def test_verifier_error_rate_above_threshold():
    cond = feed(StopRules(StopConfig(verifier_error_rate_max=0.25)),
                [{"latency/verifier_error_rate": 0.25}, {"latency/verifier_error_rate": 0.5}])
    assert cond.name == "verifier_errors" and cond.step == 2 and cond.exit_code == 86


def test_thresholds_are_off_by_default():
    bad = {"learn/kl_ref_k2_grad_theta_ref": 1e9, "learn/entropy_estimate": 0.0, "learn/d_lag/p95": 1e9,
           "latency/verifier_error_rate": 0.99}
    assert feed(StopRules(StopConfig()), [bad] * 5) is None


def test_first_condition_is_sticky_and_exit_carries_it():
    rules = StopRules(StopConfig(kl_max=0.5, d_lag_p95_max=0.1))
    feed(rules, [{"learn/d_lag/p95": 1.0}, {"learn/kl_ref_k2_grad_theta_ref": 9.0}])
    assert rules.triggered.name == "lag_p95" and rules.triggered.step == 1
    exc = StopConditionMet(rules.triggered)
    assert isinstance(exc, SystemExit) and exc.code == 85
    assert exc.condition.to_dict()["stopped"] == "lag_p95"


@pytest.mark.parametrize("field,value", [("kl_max", -1.0), ("patience", 0), ("dev_eval_drops", -1),
                                         ("verifier_error_rate_max", 1.5), ("entropy_max", math.inf),
                                         ("dev_eval_metric", "format")])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"stop.{field}"):
        from_dict(TrainConfig, {"model": {"path": "m"}, "stop": {field: value}})
    with pytest.raises(ConfigError, match="stop.entropy_min"):
        StopConfig(entropy_min=3.0, entropy_max=1.0)


def test_dev_eval_rule_needs_dev_evals():
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="stop.dev_eval_drops.*run.eval_every"):
        load_train_config(tiny, ["stop.dev_eval_drops=2", "run.eval_every=0"])
    cfg = load_train_config(tiny, ["stop.dev_eval_drops=2", "run.eval_every=5", "stop.kl_max=0.5"])
    assert cfg.stop.dev_eval_drops == 2 and cfg.stop.kl_max == 0.5 and cfg.stop.nonfinite is True


def test_generated_token_budget_ends_the_run_normally_once_reached():
    rules = StopRules(StopConfig(max_generated_tokens=1000))
    assert feed(rules, [{"system/generated_tokens": 400.0}, {"system/generated_tokens": 400.0}]) is None
    rules.observe(3, {"eval/dev_correctness": 0.5})  # an eval row generates nothing that counts
    assert rules.triggered is None and rules.generated_tokens == 800
    condition = rules.observe(4, {**HEALTHY, "system/generated_tokens": 400.0})
    assert condition.name == "max_generated_tokens" and condition.step == 4 and condition.value == 1200
    assert condition.ends_run and condition.exit_code == 0
    assert rules.summary() == {"generated_tokens": 1200, "stopped": "max_generated_tokens", "stopped_at_step": 4}
    assert StopRules(StopConfig()).summary() == {"generated_tokens": 0}  # off: counted, never stops
    off = StopRules(StopConfig())
    assert feed(off, [{"system/generated_tokens": 1e9}]) is None and off.generated_tokens == 1e9


def test_generated_token_budget_counts_the_steps_before_a_resume(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "time": 1.0, "eval/test_correctness": 0.5},
        {"step": 1, "time": 2.0, "system/generated_tokens": 300.0},
        {"step": 2, "time": 3.0, "system/generated_tokens": 300.0}]) + '{"step": 3, "ti')  # a torn last line
    rules = StopRules(StopConfig(max_generated_tokens=1000))
    assert rules.restore(log) == 600
    assert rules.observe(3, {**HEALTHY, "system/generated_tokens": 300.0}) is None
    assert rules.observe(4, {**HEALTHY, "system/generated_tokens": 300.0}).value == 1200
    assert StopRules(StopConfig()).restore(tmp_path / "absent.jsonl") == 0
    spent = StopRules(StopConfig(max_generated_tokens=600))  # resumed after the budget ended the run
    assert spent.restore(log) == 600 and spent.budget_spent()
    assert spent.summary() == {"generated_tokens": 600, "stopped": "max_generated_tokens", "stopped_at_step": 2}
    under = StopRules(StopConfig(max_generated_tokens=1000))
    assert under.restore(log) == 600 and not under.budget_spent() and under.triggered is None
    off = StopRules(StopConfig())
    assert off.restore(log) == 600 and not off.budget_spent()


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "many"])
def test_generated_token_budget_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="stop.max_generated_tokens"):
        StopConfig(max_generated_tokens=bad)
