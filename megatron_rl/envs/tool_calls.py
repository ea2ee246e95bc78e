"""Tool calls in an assistant turn (Hermes / Qwen style) and the safe arithmetic the calculator runs.

    calls, errors = parse_tool_calls('<tool_call>\\n{"name": "calculator", "arguments": '
                                     '{"expression": "2+3"}}\\n</tool_call>')
    calls[0].name, calls[0].arguments          # "calculator", {"expression": "2+3"}
    evaluate_arithmetic("(56 + -33) - 84")     # "-61"; no eval(): an AST walk over + - * / // % **

A malformed call (not JSON, no name, arguments not an object, an unclosed tag) is an error
string for the observation, never an exception: the policy learns from it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import re
from fractions import Fraction

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 400


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def has_tool_call(text: str) -> bool:
    return OPEN in text or CLOSE in text


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """(well-formed calls, one message per malformed call), in order of appearance."""
    calls, errors = [], []
    for number, match in enumerate(_BLOCK_RE.finditer(text), start=1):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as err:
            errors.append(f"tool call {number} is not valid JSON ({err.msg} at char {err.pos})")
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            errors.append(f"tool call {number} must be a JSON object with a \"name\" string")
            continue
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            errors.append(f"tool call {number}: \"arguments\" must be a JSON object, got {type(arguments).__name__}")
            continue
        calls.append(ToolCall(payload["name"], arguments))
    rest = _BLOCK_RE.sub("", text)
    if OPEN in rest or CLOSE in rest:
        errors.append(f"unbalanced {OPEN} ... {CLOSE} tags")
    return calls, errors


class ExpressionError(ValueError):
    """An expression the calculator refuses or cannot compute (the message is the observation)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ExpressionError(f"exponents must be integers with |exponent| <= {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ExpressionError("division by zero")
        elif right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ExpressionError("division by zero")
        result = _BINARY[type(node.op)](left, right)
        if len(str(result.numerator)) + len(str(result.denominator)) > MAX_DIGITS:
            raise ExpressionError("the result is too large")
        return Fraction(result)
    raise ExpressionError(f"unsupported syntax {type(node).__name__}: only numbers, parentheses and "
                           f"+ - * / // % ** are allowed")


def format_number(value: Fraction) -> str:
    """An integer as is; otherwise a decimal with up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def evaluate_arithmetic(expression: str) -> str:
    """The value of an arithmetic expression, as text; ExpressionError names what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise ExpressionError("the expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"cannot parse the expression: {err.msg}") from None
    return format_number(_value(tree.body))
