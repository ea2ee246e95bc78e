"""`calculator`: arithmetic questions answered with the help of a calculator tool.

    env = CalculatorEnvironment(CalculatorConfig())
    question = env.reset(example)     # an Example, e.g. from data.task reasoning_gym basic_arithmetic
    env.step('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "5 - 3 - 6"}}\\n</tool_call>')
    # StepResult(observation="-4", reward=None, done=False)
    env.step("Answer: -4")            # StepResult(observation="", reward=1.0, done=True)

Questions come from the data layer (`data.task: reasoning_gym`, `data.generator: basic_arithmetic`:
reasoning_gym is a dependency of the project); the final answer (a turn without a tool call) is
scored by the generator's own scorer.  The tool evaluates expressions with an AST walk
(tool_calls.evaluate_arithmetic), never Python's eval.  A malformed or unknown tool call comes
back as an observation saying what is wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.envs.answers import check_extractors, score_final_answer
from megatron_rl.envs.protocol import Environment, StepResult
from megatron_rl.envs.tool_calls import ExpressionError, evaluate_arithmetic, has_tool_call, parse_tool_calls

TOOL_NAME = "calculator"
CALL_FORMAT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "<arithmetic>"}}\n</tool_call>'


@dataclasses.dataclass(kw_only=True)
class CalculatorConfig:
    """The `calculator` environment's section."""

    answer_extractors: list[str] = dataclasses.field(default_factory=lambda: ["answer_is", "last_number"])
    """How the final answer is found in the last turn (reward/math_verifier.py EXTRACTORS, first hit wins)."""
    max_calls_per_turn: int = 4
    """Tool calls evaluated per assistant turn; more are answered with an error line."""

    def __post_init__(self) -> None:
        check_extractors(self.answer_extractors)
        if isinstance(self.max_calls_per_turn, bool) or not isinstance(self.max_calls_per_turn, int) \
                or self.max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be an int >= 1, got {self.max_calls_per_turn!r}")


def tool_schema(name: str, description: str, argument: str, argument_description: str) -> dict:
    """A one-argument function tool in the JSON-schema form chat templates take (`tools=`)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": [argument],
                       "properties": {argument: {"type": "string", "description": argument_description}}}}}


class QuestionToolEnvironment(Environment):
    """A question to answer with a tool: reset takes an example with a `question`; a turn without a
    tool call is the final answer, scored by the example's scorer (config.answer_extractors)."""

    def __init__(self, config):
        self.config = config
        self._example: Any = None

    def reset(self, example: Any) -> str:
        if not getattr(example, "question", None):
            raise ValueError(f"{self.name} needs an example with a question, got {example!r}")
        self._example = example
        return example.question

    def final_answer(self, action: str) -> StepResult | None:
        """The episode's last step when `action` holds no tool call, else None (a tool turn)."""
        if self._example is None:
            raise RuntimeError("step before reset")
        if has_tool_call(action):
            return None
        correct = score_final_answer(action, self._example, self.config.answer_extractors)
        return StepResult("", reward=correct, done=True, info={"tool_calls": 0, "tool_errors": 0})


class CalculatorEnvironment(QuestionToolEnvironment):
    name = "calculator"
    observation_role = "tool"

    def __init__(self, config: CalculatorConfig):
        super().__init__(config)

    @property
    def system_prompt(self) -> str:
        return ("Use the calculator tool for arithmetic: " + CALL_FORMAT + "\n"
                "When you know the result, reply with 'Answer: <number>' and no tool call.")

    @property
    def tools(self) -> list[dict]:
        return [tool_schema(TOOL_NAME, "Evaluate an arithmetic expression: numbers, parentheses, + - * / // % **.",
                            "expression", "the expression, e.g. (56 + -33) - 84")]

    def step(self, action: str) -> StepResult:
        final = self.final_answer(action)
        if final is not None:
            return final
        calls, errors = parse_tool_calls(action)
        lines = [f"Malformed tool call: {e}. Call the tool as {CALL_FORMAT}" for e in errors]
        failed = len(errors)
        for i, call in enumerate(calls):
            line = self._call(call.name, call.arguments) if i < self.config.max_calls_per_turn else \
                f"Error: at most {self.config.max_calls_per_turn} tool calls per turn"
            failed += line.startswith("Error")
            lines.append(line)
        return StepResult("\n".join(lines), info={"tool_calls": len(calls) + len(errors), "tool_errors": failed})

    def _call(self, name: str, arguments: dict) -> str:
        if name != TOOL_NAME:
            return f"Error: unknown tool {name!r}; the only tool is {TOOL_NAME!r}"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "Error: the calculator needs an \"expression\" string argument"
        try:
            return evaluate_arithmetic(expression)
        except ExpressionError as err:
            return f"Error: {err}"
