"""Tool-call formats per model family: parse a completion's text into content and OpenAI tool calls.

- `hermes` (Qwen2.5, Qwen3, and harnessrl's convention for templates without tools: SmolLM2, Llama 3.0,
  Gemma 3): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text
  (Qwen puts the JSON on its own line); text around the blocks is content.
- `llama3_json` (Llama 3.1/3.2/3.3): the whole message is the call, `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>` (the special token is usually skipped when decoding), several calls
  separated by `;`; a message that does not start with a call is content.
- `qwen3_coder` (Qwen3.5, Qwen3-Coder): `<tool_call><function=NAME><parameter=P>v</parameter></function></tool_call>`
  (`xmlcalls`); arguments converted by the request's tool schemas.
- `gemma4` (Gemma 4): `<|tool_call>call:NAME{key:value}<tool_call|>` (`gemma4`).
- `pythonic` (Llama 3.2 prompted so): the whole message is `[f(x=1), g(y="a")]` (`pythonic`); `llama3_json`
  accepts that shape too.
- `none`: never a tool call.

Each parser also says, for text generated so far, how much of it can already be streamed as content
(`hold`): `StreamingToolParser` releases exactly that, so what streamed is always a prefix of the final
content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from harnessrl.chat.chatml import ParsedCompletion, call_from_json, cut_blocks
from harnessrl.chat.gemma4 import Gemma4ToolParser
from harnessrl.chat.markers import opener_hold, partial_tail
from harnessrl.chat.pythonic import PythonicToolParser, parse_pythonic
from harnessrl.chat.xmlcalls import XmlToolParser

__all__ = [
    "PYTHON_TAG",
    "TOOL_PARSERS",
    "Gemma4ToolParser",
    "HermesParser",
    "Llama3JsonParser",
    "NoToolParser",
    "PythonicToolParser",
    "ToolParser",
    "XmlToolParser",
    "partial_tail",
    "tool_parser",
]

PYTHON_TAG = "<|python_tag|>"


class ToolParser(Protocol):
    """A family's tool-call format."""

    @property
    def name(self) -> str:
        """The name `engine.tool_parser` chooses it by."""
        ...

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Split text (end-of-turn marker already removed) into content and tool calls (`tools`: the
        request's tools, for formats whose arguments are typed by their schemas)."""
        ...

    def hold(self, text: str) -> tuple[int, bool]:
        """How many leading characters of `text` are content for sure, and whether nothing after them
        can be streamed any more (a call has begun)."""
        ...


@dataclass(frozen=True)
class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks; malformed blocks stay in the content."""

    name: str = "hermes"
    open: str = "<tool_call>"
    close: str = "</tool_call>"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Content with the well-formed blocks cut out, and their calls in order."""
        return cut_blocks(
            text, self.open, self.close, lambda b: call_from_json(b, ("arguments", "parameters"))
        )

    def hold(self, text: str) -> tuple[int, bool]:
        """Content up to the first opener (then blocked), or all but a tail that may become one."""
        return opener_hold(text, self.open)


@dataclass(frozen=True)
class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the message is `[<|python_tag|>]{"name", "parameters"}[; {...}]`."""

    name: str = "llama3_json"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """All calls when the message is made of calls (JSON, or a pythonic call list); otherwise the
        whole text as content."""
        pythonic = parse_pythonic(text)
        if pythonic:
            return ParsedCompletion(content="", tool_calls=pythonic)
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            return ParsedCompletion(content=text)
        calls = []
        for piece in _split_json_objects(body):
            call = call_from_json(piece, ("parameters", "arguments"))
            if call is None:
                return ParsedCompletion(content=text)
            calls.append(call)
        return ParsedCompletion(content="", tool_calls=calls) if calls else ParsedCompletion(content=text)

    def hold(self, text: str) -> tuple[int, bool]:
        """Nothing while the message may still be a call; everything once it cannot be one."""
        body = text.lstrip()
        if body.startswith(("{", "[", PYTHON_TAG)):
            return 0, True
        if not body or PYTHON_TAG.startswith(body):
            return 0, False
        return len(text), False


def _split_json_objects(body: str) -> list[str]:
    """`{...}; {...}` into its objects (a `;` inside a JSON string does not split)."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return [body]  # not a clean sequence: let the caller fail on it as one piece
        out.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return out


@dataclass(frozen=True)
class NoToolParser:
    """A model without tool calls: everything is content."""

    name: str = "none"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """The text as content."""
        return ParsedCompletion(content=text)

    def hold(self, text: str) -> tuple[int, bool]:
        """All of it."""
        return len(text), False


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        HermesParser(),
        Llama3JsonParser(),
        XmlToolParser(),
        Gemma4ToolParser(),
        PythonicToolParser(),
        NoToolParser(),
    )
}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; the error lists the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(["auto", *TOOL_PARSERS])
        raise ValueError(f"engine.tool_parser '{name}' is unknown; use one of: {known}") from None
