"""A user's reward function by import path (reward.function; megatron_rl/reward/function.py): loaded and
checked when the config is, called in the verifier pool's workers with the pool's contract (timeouts and
exceptions are error codes, never zeros), its components summed, its file's digest its grader version, and
correctness only ever its "correct" component.

    python -m pytest tests/unit/test_reward_function.py -q
"""

from __future__ import annotations

import math
import textwrap

import pytest

from megatron_rl.envs.example import Example
from megatron_rl.evaluation import Decoding, EvalResult, example_outcome
from megatron_rl.metrics import logged_test_evals
from megatron_rl.reward.math_verifier import RewardConfig, Score
from megatron_rl.reward.pool import VerifierPool, summarize_scores

pytestmark = pytest.mark.unit

PLUGIN = '''
import math, time

def exact(*, prompt, response, answer, **fields):
    """1 for the right answer, 0.1 for any answer: partial credit."""
    right = response.strip() == answer
    return {"correct": float(right), "tried": 0.1}

def partial(prompt, response, answer, **fields):
    return 0.1

def echo(*, prompt, response, answer, question, id, **fields):
    return {"correct": float(prompt.startswith("Q: ") and question in prompt and fields.get("level") == 3)}

def raises(**kw):
    raise KeyError("no such field")

def sleeps(**kw):
    time.sleep(30)
    return 1.0

def nan(**kw):
    return math.nan

def half_correct(**kw):
    return {"correct": 0.5}

def text(**kw):
    return "1.0"

def no_answer(*, prompt, response):
    return 1.0

not_callable = 3
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN)
    return path


def cfg_of(plugin, name, **kw) -> RewardConfig:
    return RewardConfig(function=f"{plugin}:{name}", num_workers=1, **kw)


def test_a_float_is_one_component_named_after_the_function_and_is_never_correctness(plugin):
    with VerifierPool(cfg_of(plugin, "partial")) as pool:
        [s] = pool.score(["7"], ["3"])
    assert s.ok and s.reward == pytest.approx(0.1) and s.components == {"partial": pytest.approx(0.1)}
    assert s.correctness is None and s.format is None
    assert s.grader_version.startswith("function:partial@")


def test_components_sum_into_the_reward_and_correct_is_correctness(plugin):
    with VerifierPool(cfg_of(plugin, "exact")) as pool:
        right, wrong = pool.score(["3", "7"], ["3", "3"])
    assert right.components == {"correct": 1.0, "tried": pytest.approx(0.1)} and right.reward == pytest.approx(1.1)
    assert right.correctness == 1.0 and wrong.correctness == 0.0 and wrong.reward == pytest.approx(0.1)


def test_the_function_gets_the_prompt_and_the_examples_fields(plugin):
    ex = Example(id="e1", question="2+2", answer="4", metadata='{"level": 3, "answer": "not this", "prompt": "x"}')
    fields = ex.reward_fields()
    assert fields == {"level": 3, "question": "2+2", "id": "e1", "answer": "4"}  # the example's answer wins
    with VerifierPool(cfg_of(plugin, "echo")) as pool:
        [s] = pool.score(["4"], [ex.reference], contexts=[{"prompt": "Q: 2+2\nA:", **fields}])
        [other] = pool.score(["4"], [ex.reference], contexts=[{"prompt": "no question here", **fields}])
    assert s.correctness == 1.0 and other.correctness == 0.0


@pytest.mark.parametrize("name, detail", [("raises", "KeyError"), ("nan", "finite number"),
                                          ("half_correct", "'correct' must be 0 or 1"),
                                          ("text", "finite number")])
def test_a_function_error_is_an_error_code_not_a_zero(plugin, name, detail):
    with VerifierPool(cfg_of(plugin, name)) as pool:
        [s] = pool.score(["4"], ["4"])
        counts = pool.counters()
    assert s.error == "grader_error" and s.reward is None and detail in s.detail
    assert counts["grader_error"] == 1


def test_a_function_past_its_timeout_is_a_timeout_and_counted(plugin):
    with VerifierPool(cfg_of(plugin, "sleeps", timeout_s=1.0)) as pool:
        [s] = pool.score(["4"], ["4"])
        counts = pool.counters()
    assert s.error == "timeout" and s.reward is None and counts["timeout"] == 1


@pytest.mark.parametrize("ref, message", [
    ("no_colon.py", "must be 'pkg.module:name'"),
    ("{dir}/missing.py:fn", "does not exist"),
    ("{plugin}:absent", "has no attribute 'absent'"),
    ("{plugin}:not_callable", "not callable"),
    ("{plugin}:no_answer", "lacks answer"),
    ("{broken}:fn", "importing"),
    ("no_such_pkg_xyz.rewards:fn", "importing no_such_pkg_xyz.rewards failed"),
])
def test_a_bad_reference_is_refused_when_the_config_is_built(plugin, tmp_path, ref, message):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_abc\n")
    with pytest.raises(ValueError, match="reward.function") as err:
        RewardConfig(function=ref.format(dir=tmp_path, plugin=plugin, broken=broken))
    assert message in str(err.value)


def test_a_function_replaces_the_grader_and_says_so_when_both_are_set(plugin):
    with pytest.raises(ValueError, match="reward.function replaces reward.grader"):
        RewardConfig(function=f"{plugin}:exact", grader="math_verify")


def test_the_grader_version_is_the_files_digest(plugin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RewardConfig(function="my_rewards.py:exact")  # a relative path: resolved when the config is built
    assert cfg.function == f"{plugin}:exact"
    before = cfg.grader_version()
    plugin.write_text(PLUGIN + "\n# edited\n")
    assert cfg.grader_version() != before and cfg.grader_version().startswith("function:exact@")


def test_a_module_form_imports_from_the_working_directory(plugin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RewardConfig(function="my_rewards:partial", num_workers=1)
    assert cfg.function == "my_rewards:partial"
    with VerifierPool(cfg) as pool:
        [s] = pool.score(["x"], ["y"])
    assert s.reward == pytest.approx(0.1)


def _result(scores_per_example) -> EvalResult:
    outcomes = [example_outcome(Example(id=str(i), question="q", answer="a"), ["r"] * len(sc), sc)
                for i, sc in enumerate(scores_per_example)]
    return EvalResult(split="test", decoding=Decoding(), outcomes=outcomes)


def test_eval_never_reports_a_partial_credit_reward_as_correctness():
    partial = Score(reward=0.1, correctness=None, format=None, overlong=None, error=None, grader_version="g",
                    components={"partial": 0.1})
    failed = Score.failed("timeout", "g")
    summary = _result([[partial], [partial], [failed]]).summary()
    assert summary["reward"] == pytest.approx(0.1) and summary["verifier_errors"] == 1
    assert summary["correctness"] is None and summary["format"] is None and summary["pass@1"] is None
    assert summarize_scores([partial])["reward_mean"] == pytest.approx(0.1)
    assert math.isnan(summarize_scores([partial])["correctness_mean"])


def test_eval_with_a_correct_component_reports_it_as_correctness():
    def score(c):
        return Score(reward=c + 0.1, correctness=c, format=None, overlong=None, error=None, grader_version="g")
    summary = _result([[score(1.0)], [score(0.0)]]).summary()
    assert summary["correctness"] == pytest.approx(0.5) and summary["pass@1"] == pytest.approx(0.5)
    assert summary["reward"] == pytest.approx(0.6) and summary["format"] is None


def test_a_resumed_final_eval_without_correctness_is_read_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3, "eval/test_reward": 0.1, "eval/test_verifier_errors": 0}\n'
                    '{"step": 4, "eval/test_reward": 0.5, "eval/test_correctness": 0.25, "eval/test_format": 1.0}\n'
                    '{"step": 4, "learn/loss": 1.0}\n')
    assert logged_test_evals(path) == {3: {"reward": 0.1, "correctness": None, "format": None},
                                       4: {"reward": 0.5, "correctness": 0.25, "format": 1.0}}


def test_a_local_closure_is_shipped_by_value_to_the_pools_processes():
    from megatron_rl.reward.function import with_callable

    bonus = 0.25

    def closing_over(*, prompt, response, answer, **fields):
        return {"correct": float(response == answer), "bonus": bonus}

    cfg = with_callable(RewardConfig(num_workers=1, grader="math_verify"), closing_over)
    assert cfg.function.startswith("callable:closing_over@") and cfg.grader == "math"
    assert cfg.grader_version() == "function:" + cfg.function.split(":", 1)[1]
    with VerifierPool(cfg) as pool:
        right, wrong = pool.score(["4", "5"], ["4", "4"])
    assert right.components == {"correct": 1.0, "bonus": 0.25} and wrong.correctness == 0.0
    assert with_callable(RewardConfig(), lambda **kw: 1.0).function.startswith("callable:_lambda_@")


def test_a_callable_from_another_process_is_refused_naming_the_forms_to_use():
    with pytest.raises(ValueError, match="from the command line name a file"):
        RewardConfig(function="callable:reward@0123456789ab")
