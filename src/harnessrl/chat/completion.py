"""From a completion's text to what a harness receives: reasoning, content and tool calls, whole or streamed.

`CompletionRules` holds a family's rules (its tool-call format, its end-of-turn markers, whether it
thinks in `<think>` blocks); `parse` splits a whole completion, and `CompletionStream` splits one while
it is generated, releasing only text that the final split keeps: every streamed piece of content (and
of reasoning) is a prefix of the final content (and reasoning), so the rest can be sent at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harnessrl.chat.chatml import ParsedCompletion
from harnessrl.chat.markers import partial_tail
from harnessrl.chat.reasoning import ThinkTags, reasoning_progress, split_reasoning
from harnessrl.chat.toolcalls import HermesParser, ToolParser


@dataclass(frozen=True)
class CompletionRules:
    """How a family's completion text splits into reasoning, content and tool calls."""

    tools: ToolParser = field(default_factory=HermesParser)
    stop_texts: tuple[str, ...] = ()
    think: ThinkTags | None = None
    think_started: bool = False

    def strip_stop(self, text: str) -> str:
        """The text without an end-of-turn marker at its very end."""
        for stop in self.stop_texts:
            if stop and text.endswith(stop):
                return text[: -len(stop)]
        return text

    @property
    def call_open(self) -> str | None:
        """The tool-call opener that ends an open thinking block: only where the prompt opened the block
        (Qwen3.5 may call a tool before `</think>`)."""
        opener = getattr(self.tools, "open", None)
        return opener if self.think_started and isinstance(opener, str) else None

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Split a whole completion; malformed tool calls stay in the content (`tools`: the request's
        tools, whose schemas type the arguments of formats that write them as text)."""
        text = self.strip_stop(text)
        reasoning = None
        if self.think is not None:
            reasoning, text = split_reasoning(text, self.think, self.think_started, self.call_open)
        parsed = self.tools.parse(text, tools)
        parsed.reasoning_content = reasoning
        return parsed

    def visible(self, text: str) -> str:
        """Generated-so-far text without a tail that may be (the start of) an end-of-turn marker."""
        cut = max((partial_tail(text, s, full=True) for s in self.stop_texts if s), default=0)
        return text[: len(text) - cut]


class CompletionStream:
    """Split a completion into reasoning and content deltas while it is generated; tool calls at the end.

    Content before a tool call streams as it arrives; from the first sign of a call (the family's
    parser decides) nothing more streams, and `finish` parses the whole text.
    """

    def __init__(self, rules: CompletionRules, tools: list[dict[str, Any]] | None = None) -> None:
        self.rules = rules
        self.tools = tools
        self.text = ""
        self.content_sent = ""
        self.reasoning_sent = ""
        self.blocked = False  # a tool call may have started: hold the content from here

    def feed_parts(self, delta: str) -> tuple[str, str]:
        """Add generated text; return the (reasoning, content) that can be sent now."""
        self.text += delta
        visible = self.rules.visible(self.text)
        reasoning, content = "", visible
        if self.rules.think is not None:
            reasoning, maybe = reasoning_progress(
                visible, self.rules.think, self.rules.think_started, self.rules.call_open
            )
            content = "" if maybe is None else maybe
        r_delta = reasoning[len(self.reasoning_sent) :]
        self.reasoning_sent = max(self.reasoning_sent, reasoning, key=len)
        if self.blocked:
            return r_delta, ""
        safe, self.blocked = self.rules.tools.hold(content)
        c_delta = content[len(self.content_sent) : max(safe, len(self.content_sent))]
        self.content_sent += c_delta
        return r_delta, c_delta

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that can be sent now (reasoning is kept for later)."""
        return self.feed_parts(delta)[1]

    def finish(self, final_text: str | None = None) -> tuple[ParsedCompletion, str]:
        """The parsed completion and the content not streamed yet (`final_text` replaces the
        accumulated text when the engine trimmed it, e.g. at a stop string)."""
        parsed = self.rules.parse(self.text if final_text is None else final_text, self.tools)
        if not parsed.content.startswith(self.content_sent):
            raise ValueError("streamed content is not a prefix of the final content")
        if self.reasoning_sent and not (parsed.reasoning_content or "").startswith(self.reasoning_sent):
            raise ValueError("streamed reasoning is not a prefix of the final reasoning")
        return parsed, parsed.content[len(self.content_sent) :]

    def reasoning_rest(self, parsed: ParsedCompletion) -> str:
        """The reasoning of `parsed` not streamed yet."""
        return (parsed.reasoning_content or "")[len(self.reasoning_sent) :]
