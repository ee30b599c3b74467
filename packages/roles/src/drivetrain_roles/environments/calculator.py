"""The ``calculator`` environment: arithmetic questions a model answers with the help of a calculator tool.

The tool evaluates ``+ - * / // % **`` on numbers from a syntax tree (``ast``), never with ``eval``: a name,
a call, an attribute or any other syntax is refused, and so are exponents, operands and results past fixed
bounds (``9**9**9`` would otherwise hold a process for minutes). A refusal or a division by zero raises
:class:`CalculatorError`, which :class:`~.tools.ToolEnvironment` hands the model as an ``Error: ...`` tool
message. The episode's reward is exact match: 1 when the model's answer (its first turn without a call) is the
row's ``answer``, else 0; an episode that never answers ends at the turn limit with reward 0.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Message

from .tools import ToolEnvironment

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 60
"""Bounds of one evaluation: the expression's length, any exponent's size, and the digits of any operand or
intermediate result (numerator and denominator alike)."""

_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the model reads the message)."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, such as "123*45+678".
    """
    value = evaluate(expression)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``.

    Raises:
        CalculatorError: not a string of arithmetic, past a bound, or a division by zero.
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"{expression!r} is not an arithmetic expression ({e.msg})") from e
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    """The value of one node of the tree; anything but numbers and arithmetic operators is refused."""
    number = node.value if isinstance(node, ast.Constant) else None
    if isinstance(number, int | float) and not isinstance(number, bool):
        if not math.isfinite(number):
            raise CalculatorError(f"{ast.unparse(node)} is not a finite number")
        return _bounded(Fraction(number))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise CalculatorError(
                f"exponents must be whole numbers between -{MAX_EXPONENT} and {MAX_EXPONENT}"
            )
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise CalculatorError("division by zero")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits")
    return value


def exact_answer(example: Mapping[str, Any], answer: str) -> float:
    """1.0 when ``answer`` (stripped) is the row's ``answer`` column, else 0.0."""
    return float(answer.strip() == str(example["answer"]).strip())


class CalculatorEnvironment(ToolEnvironment):
    """A question from a data set row, the ``calculator`` tool, and an exact-match reward on the answer.

    Args:
        messages_key: the row's column holding the conversation; the episode starts from its turns before the
            first assistant turn (a row may hold a whole worked trajectory, as the SFT data do).
        tool_timeout_s: how long one calculation may run.
    """

    def __init__(self, *, messages_key: str = "messages", tool_timeout_s: float = 5.0) -> None:
        super().__init__([calculator], reward=exact_answer, tool_timeout_s=tool_timeout_s)
        self.messages_key = messages_key

    def _reset(self, example: Mapping[str, Any]) -> list[Message]:
        messages = example.get(self.messages_key)
        if not isinstance(messages, list) or "answer" not in example:
            raise ConfigError(
                f"the calculator environment needs rows with a {self.messages_key!r} list of chat messages and an "
                f"'answer'; this row has {sorted(example)}. Use the data of model.path=builtin:calculator or set "
                "environment.options.messages_key."
            )
        first_answer = next(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages)
        )
        prompt = super()._reset({"messages": messages[:first_answer]})
        self._example = example  # the reward reads the row's answer
        return prompt
