"""Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`. Pure functions.

Gemma 4's template (tests/fixtures/chat_templates/gemma4.jinja) writes a call's arguments with its
`format_argument` macro: keys bare, strings between `<|"|>` quotes, `true`/`false`, numbers as they are,
objects `{k:v,...}` and lists `[v,...]`. Parsing reads that grammar back into JSON values; a block that
does not follow it stays in the content. A bare word that is no number, boolean or null is kept as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harnessrl.chat.chatml import ParsedCompletion, cut_blocks, openai_tool_call
from harnessrl.chat.markers import opener_hold

QUOTE = '<|"|>'


class _Malformed(ValueError):
    pass


class _Reader:
    """A recursive-descent reader of Gemma 4's argument syntax."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def value(self) -> Any:
        if self.text.startswith(QUOTE, self.pos):
            end = self.text.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise _Malformed("unterminated string")
            out, self.pos = self.text[self.pos + len(QUOTE) : end], end + len(QUOTE)
            return out
        if self.text.startswith("{", self.pos):
            return self.mapping()
        if self.text.startswith("[", self.pos):
            return self.sequence()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        word, self.pos = self.text[self.pos : end].strip(), end
        return _scalar(word)

    def key(self) -> str:
        if self.text.startswith(QUOTE, self.pos):
            out = self.value()
            assert isinstance(out, str)
        else:
            colon = self.text.find(":", self.pos)
            if colon < 0:
                raise _Malformed("a key without ':'")
            out, self.pos = self.text[self.pos : colon].strip(), colon
        if not self.text.startswith(":", self.pos) or not out:
            raise _Malformed("expected 'key:'")
        self.pos += 1
        return out

    def mapping(self) -> dict[str, Any]:
        self.pos += 1  # '{'
        out: dict[str, Any] = {}
        while not self.text.startswith("}", self.pos):
            key = self.key()
            out[key] = self.value()
            self._separator("}")
        self.pos += 1
        return out

    def sequence(self) -> list[Any]:
        self.pos += 1  # '['
        out: list[Any] = []
        while not self.text.startswith("]", self.pos):
            out.append(self.value())
            self._separator("]")
        self.pos += 1
        return out

    def _separator(self, closer: str) -> None:
        if self.text.startswith(",", self.pos):
            self.pos += 1
        elif not self.text.startswith(closer, self.pos):
            raise _Malformed(f"expected ',' or {closer!r}")


def _scalar(word: str) -> Any:
    if word in ("true", "false"):
        return word == "true"
    if word in ("null", "None"):
        return None
    try:
        value = json.loads(word)
    except json.JSONDecodeError:
        return word
    return value if isinstance(value, int | float) else word


def parse_call_body(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call of `call:NAME{...}`, or None when the body is not one."""
    body = body.strip()
    brace = body.find("{")
    if not body.startswith("call:") or brace < 0 or not body.endswith("}"):
        return None
    name = body[len("call:") : brace].strip()
    reader = _Reader(body[brace:])
    try:
        args = reader.mapping()
    except (_Malformed, IndexError):
        return None
    if not name or reader.pos != len(reader.text):
        return None
    return openai_tool_call(name, args)


@dataclass(frozen=True)
class Gemma4ToolParser:
    """Gemma 4's `<|tool_call>call:NAME{...}<tool_call|>` blocks."""

    name: str = "gemma4"
    open: str = "<|tool_call>"
    close: str = "<tool_call|>"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Content with the well-formed blocks cut out, and their calls in order."""
        return cut_blocks(text, self.open, self.close, parse_call_body)

    def hold(self, text: str) -> tuple[int, bool]:
        """Content up to the first `<|tool_call>` (then blocked), or all but a tail that may become one."""
        return opener_hold(text, self.open)
