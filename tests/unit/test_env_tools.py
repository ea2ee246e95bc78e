"""The calculator and guess_number environments (issue 28): tool calls, scoring, terminal reasons.

    python -m pytest tests/unit/test_env_tools.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.data.reasoning_gym_task import make_reasoning_gym
from megatron_rl.envs.calculator import CalculatorConfig, CalculatorEnvironment
from megatron_rl.envs.example import Example
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from megatron_rl.envs.tool_calls import ExpressionError, evaluate_arithmetic, parse_tool_calls


def _call(expression: str, name: str = "calculator") -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def test_arithmetic_is_exact_and_refuses_python():
    assert evaluate_arithmetic("( 56 + -33 ) - 84") == "-61"
    assert evaluate_arithmetic("7 / 2") == "3.5" and evaluate_arithmetic("2 ** 10") == "1024"
    assert evaluate_arithmetic("1 / 3 * 3") == "1"
    for bad, why in (("__import__('os').system('id')", "unsupported syntax Call"), ("x + 1", "unsupported syntax Name"),
                     ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "exponents"), ("2 +", "cannot parse"),
                     ("(1" + "+1" * 150 + ")", "longer than"), ("'a' * 3", "unsupported syntax Constant")):
        with pytest.raises(ExpressionError, match=why):
            evaluate_arithmetic(bad)


def test_tool_call_parsing_names_what_is_malformed():
    calls, errors = parse_tool_calls(_call("1+1") + " and " + _call("2*3"))
    assert [c.arguments["expression"] for c in calls] == ["1+1", "2*3"] and errors == []
    for text, why in (("<tool_call>{not json}</tool_call>", "not valid JSON"),
                      ('<tool_call>{"arguments": {}}</tool_call>', "\"name\" string"),
                      ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', "must be a JSON object"),
                      ('<tool_call>{"name": "calculator"', "unbalanced")):
        calls, errors = parse_tool_calls(text)
        assert calls == [] and len(errors) == 1 and why in errors[0], (text, errors)


@pytest.fixture(scope="module")
def arithmetic():
    return make_reasoning_gym("basic_arithmetic", {"max_terms": 3, "max_digits": 2}, seed=0, train_size=5,
                              holdout_size=2)["train"]


def test_calculator_uses_the_generators_questions_and_scorer(arithmetic):
    env = CalculatorEnvironment(CalculatorConfig())
    example = arithmetic[0]
    assert env.reset(example) == example.question
    expression = example.question.removeprefix("Calculate ").rstrip(".")
    result = env.step("Let me compute.\n" + _call(expression))
    assert result.observation == evaluate_arithmetic(expression) == example.answer
    assert not result.done and result.reward is None and result.info == {"tool_calls": 1, "tool_errors": 0}
    final = env.step(f"Answer: {example.answer}")
    assert final.done and final.reward == 1.0
    env.reset(example)
    wrong = env.step(f"Answer: {int(example.answer) + 1}")
    assert wrong.done and wrong.reward == 0.0
    assert env.step("I have no idea.").reward == 0.0


def test_calculator_answers_malformed_and_unknown_calls_with_an_observation():
    env = CalculatorEnvironment(CalculatorConfig(max_calls_per_turn=1))
    env.reset(Example(id="q", question="What is 2+2?", answer="4"))
    result = env.step("<tool_call>{oops}</tool_call>")
    assert not result.done and result.observation.startswith("Malformed tool call: tool call 1 is not valid JSON")
    assert result.info == {"tool_calls": 1, "tool_errors": 1}
    result = env.step(_call("2+2", name="shell") + _call("1/0"))
    assert result.observation.splitlines() == ["Error: unknown tool 'shell'; the only tool is 'calculator'",
                                               "Error: at most 1 tool calls per turn"]
    assert env.step(_call("1/0", name="calculator")).observation == "Error: division by zero"
    with pytest.raises(ValueError, match="answer_extractors"):
        CalculatorConfig(answer_extractors=["magic"])


def test_guess_number_feedback_and_its_ends():
    env = GuessNumberEnvironment(GuessNumberConfig(low=1, high=100, max_guesses=3))
    examples = env.make_examples(20, seed=3)
    assert examples == env.make_examples(20, seed=3) and len({e.answer for e in examples}) > 5
    hidden = Example(id="g", question=env.question(), answer="37")
    env.reset(hidden)
    assert env.step("I guess 50").observation == "lower"
    assert env.step("hmm, 20?").observation == "higher"
    assert env.step("no idea").observation.startswith("No guess found")  # does not use a guess
    assert env.step("500").observation.startswith("500 is outside the range")
    done = env.step("37")
    assert (done.observation, done.reward, done.done) == ("Correct!", 1.0, True)
    env.reset(hidden)
    env.step("1"), env.step("2")
    last = env.step("3")
    assert (last.reward, last.done) == (0.0, True) and "it was 37" in last.observation
    with pytest.raises(ValueError, match="outside"):
        env.reset(Example(id="g", question="?", answer="101"))
    with pytest.raises(ValueError, match="high must be > low"):
        GuessNumberConfig(low=5, high=5)
