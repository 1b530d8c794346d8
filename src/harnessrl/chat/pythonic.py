"""Pythonic tool calls (Llama 3.2 and 4 when prompted so): the message is `[f(x=1), g(y="a")]`. Pure functions.

The whole message (after optional `<|python_start|>` ... `<|python_end|>` markers and whitespace) is a
Python list of calls with keyword arguments whose values are literals (strings, numbers, booleans,
None, lists, dicts); it is read with `ast` (nothing is evaluated). A message that is not such a list is
content. `PythonicToolParser` is the `pythonic` format; `Llama3JsonParser` also accepts this shape.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from harnessrl.chat.chatml import ParsedCompletion, openai_tool_call

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _literal(node: ast.expr) -> Any:
    value = ast.literal_eval(node)
    if isinstance(value, tuple | set | bytes | complex):
        raise ValueError("not a JSON value")
    return value


def _call(node: ast.expr) -> dict[str, Any] | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    func = node.func
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        name = f"{func.value.id}.{func.attr}"  # namespaced tools (`ns.member`)
    else:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None  # **kwargs
        args[kw.arg] = _literal(kw.value)
    return openai_tool_call(name, args)


def _body(text: str) -> str:
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :]
        body = body[: -len(PYTHON_END)] if body.endswith(PYTHON_END) else body
    return body.strip()


def parse_pythonic(text: str) -> list[dict[str, Any]] | None:
    """The calls of a message that is a pythonic call list, or None when it is not one."""
    body = _body(text)
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        try:
            call = _call(node)
        except (ValueError, TypeError, SyntaxError):
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def pythonic_hold(text: str) -> tuple[int, bool]:
    """Nothing while the message may still be a call list; everything once it cannot be one."""
    body = text.lstrip()
    if body.startswith(("[", PYTHON_START)):
        return 0, True
    if not body or PYTHON_START.startswith(body):
        return 0, False
    return len(text), False


@dataclass(frozen=True)
class PythonicToolParser:
    """The whole message is `[f(x=1), g(y="a")]`."""

    name: str = "pythonic"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """All calls when the message is a call list; otherwise the whole text as content."""
        calls = parse_pythonic(text)
        return ParsedCompletion(content="", tool_calls=calls) if calls else ParsedCompletion(content=text)

    def hold(self, text: str) -> tuple[int, bool]:
        """See `pythonic_hold`."""
        return pythonic_hold(text)
