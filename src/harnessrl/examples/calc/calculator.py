"""A safe arithmetic evaluator: the calculator tool of the `calc` example (no `eval`)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalcError(ValueError):
    """The expression is not plain arithmetic or cannot be computed."""


def evaluate(expression: str) -> float:
    """Evaluate `+ - * / // % **` over numbers and parentheses."""
    if len(expression) > 200:
        raise CalcError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalcError(f"not an arithmetic expression: {expression!r}") from e
    return float(_eval(tree.body))


def _eval(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise CalcError("exponent too large")
        try:
            return float(_BINOPS[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as e:
            raise CalcError(str(e)) from e
    raise CalcError("only numbers, + - * / // % ** and parentheses are allowed")


def format_number(x: float) -> str:
    """Print integers without a decimal point and other numbers to 6 decimals."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.6f}".rstrip("0").rstrip(".")
