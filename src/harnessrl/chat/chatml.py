"""Chat rendering and tool-call parsing for ChatML models (SmolLM2 and its family). Pure functions.

SmolLM2's own template is plain ChatML with no tool support, and it inserts a default system prompt
when the conversation has none. harnessrl uses one documented convention for tools on such models
(Hermes/Qwen style), shared by the engine (passthrough) and the gateway (token-in-token-out):

- tool schemas are appended to the system turn under a `# Tools` heading, one JSON object per line;
- the model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message with `tool_calls` is rendered back as its content followed by those blocks;
- a tool result is a `tool` turn: `<|im_start|>tool\\n{content}<|im_end|>\\n`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChatTemplate:
    """A ChatML-style template: turn markers and the default system prompt."""

    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    default_system: str | None = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    tool_call_open: str = "<tool_call>"
    tool_call_close: str = "</tool_call>"


SMOLLM2 = ChatTemplate()


class ChatFormatError(ValueError):
    """A message list that cannot be rendered; the message names the offending field."""


def content_text(content: Any, where: str = "content") -> str:
    """Flatten OpenAI message content (a string, None, or a list of text parts) into text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatFormatError(f"{where}[{i}].text must be a string")
                parts.append(text)
            else:
                raise ChatFormatError(f"{where}[{i}] must be a text part; only text content is supported")
        return "".join(parts)
    raise ChatFormatError(f"{where} must be a string, null or a list of text parts")


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The text appended to the system turn that describes the callable tools."""
    lines = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        spec = {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {},
        }
        lines.append(json.dumps(spec, ensure_ascii=False))
    return (
        "# Tools\nYou can call these functions (JSON schemas):\n"
        + "\n".join(lines)
        + '\nTo call one, write <tool_call>{"name": <function-name>, "arguments": <arguments-object>}</tool_call>'
        + " and wait for its result in a tool message."
    )


def render_tool_call(name: str, arguments: Any, template: ChatTemplate = SMOLLM2) -> str:
    """Render one tool call as the model is asked to write it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # keep the raw string: the model's own (invalid) JSON is what it wrote
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{template.tool_call_open}{body}{template.tool_call_close}"


def _message_body(msg: dict[str, Any], i: int, template: ChatTemplate) -> str:
    text = content_text(msg.get("content"), where=f"messages[{i}].content")
    calls = msg.get("tool_calls") or []
    if calls and msg.get("role") != "assistant":
        raise ChatFormatError(f"messages[{i}].tool_calls is only allowed on assistant messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.name must be a string")
        text += render_tool_call(fn["name"], fn.get("arguments", {}), template)
    return text


def _role(msg: Any, i: int) -> str:
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ChatFormatError(f"messages[{i}] must be an object with a string 'role'")
    role = msg["role"]
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ChatFormatError(f"messages[{i}].role '{role}' is not one of system, user, assistant, tool")
    return "system" if role == "developer" else str(role)


def render_turn(msg: dict[str, Any], i: int, template: ChatTemplate = SMOLLM2) -> str:
    """One message (at index `i > 0`, or a system message) as `<|im_start|>role\nbody<|im_end|>\n`."""
    return f"{template.im_start}{_role(msg, i)}\n{_message_body(msg, i, template)}{template.im_end}\n"


def generation_prompt(template: ChatTemplate = SMOLLM2) -> str:
    """The text that opens the assistant's turn."""
    return f"{template.im_start}assistant\n"


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: ChatTemplate = SMOLLM2,
) -> str:
    """Render OpenAI-style messages (and tools) into the prompt text the model sees."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out: list[str] = []
    for i, msg in enumerate(messages):
        role = _role(msg, i)
        if i == 0:
            out.append(_first_turn(msg, role, tools, template))
            continue
        out.append(render_turn(msg, i, template))
    if add_generation_prompt:
        out.append(generation_prompt(template))
    return "".join(out)


def _first_turn(
    msg: dict[str, Any], role: str, tools: list[dict[str, Any]] | None, template: ChatTemplate
) -> str:
    body = _message_body(msg, 0, template)
    if role == "system":
        if tools:
            body = f"{body}\n\n{tools_block(tools)}"
        return f"{template.im_start}system\n{body}{template.im_end}\n"
    head = ""
    if template.default_system is not None or tools:
        system = template.default_system or ""
        if tools:
            system = f"{system}\n\n{tools_block(tools)}" if system else tools_block(tools)
        head = f"{template.im_start}system\n{system}{template.im_end}\n"
    return f"{head}{template.im_start}{role}\n{body}{template.im_end}\n"


def normalize_message(m: Any) -> tuple[Any, ...]:
    """A comparable form of a message: role, text content, and tool calls with parsed arguments.

    Two messages that render to the same prompt normalise equal (SDKs echo extra keys such as
    `refusal` or `annotations`, and may re-serialise tool-call arguments).
    """
    if not isinstance(m, dict):
        return (repr(m),)
    role = "system" if m.get("role") == "developer" else m.get("role")
    try:
        text = content_text(m.get("content"))
    except ChatFormatError:
        text = repr(m.get("content"))
    calls = [
        (name, json.dumps(args, sort_keys=True)) for _, name, args in tool_call_parts(m.get("tool_calls"))
    ]
    return (role, text, tuple(calls))


def tool_call_parts(tool_calls: Any) -> list[tuple[Any, Any, Any]]:
    """(id, name, arguments) of each OpenAI-style tool call, the arguments parsed from their JSON
    string when they are valid JSON (kept as given otherwise); malformed entries give Nones."""
    out = []
    for c in tool_calls or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((c.get("id") if isinstance(c, dict) else None, fn.get("name"), args))
    return out


@dataclass
class ParsedCompletion:
    """A completion's text split into plain content, tool calls (OpenAI shape) and, for reasoning
    models, the thinking text (None when the completion has no thinking block)."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_content: str | None = None


def cut_blocks(
    text: str, open_: str, close: str, read_call: Callable[[str], dict[str, Any] | None]
) -> ParsedCompletion:
    """`text` with its closed `open_ ... close` blocks that `read_call` reads as a tool call cut out, and
    those calls in order; a block it cannot read (None) stays part of the content."""
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = search = 0
    while (start := text.find(open_, search)) >= 0:
        end = text.find(close, start + len(open_))
        if end < 0:
            break
        search = end + len(close)
        call = read_call(text[start + len(open_) : end])
        if call is None:
            continue
        parts.append(text[pos:start])
        calls.append(call)
        pos = search
    parts.append(text[pos:])
    return ParsedCompletion(content="".join(parts), tool_calls=calls)


_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def new_tool_call_id() -> str:
    """A fresh id for a tool call, in OpenAI's `call_...` style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_completion(text: str, template: ChatTemplate = SMOLLM2) -> ParsedCompletion:
    """Split generated text into content and well-formed tool calls; malformed blocks stay as text."""
    if template.im_end and text.endswith(template.im_end):
        text = text[: -len(template.im_end)]
    content_parts: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        call = call_from_json(m.group(1), ("arguments",))
        if call is None:
            continue  # not a valid call: it remains part of the content
        content_parts.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    content_parts.append(text[pos:])
    return ParsedCompletion(content="".join(content_parts), tool_calls=calls)


def openai_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One tool call in OpenAI's shape (arguments as a JSON string, a fresh `call_...` id)."""
    args_text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": args_text}}


def call_from_json(body: str, args_keys: tuple[str, ...]) -> dict[str, Any] | None:
    """A tool call from a JSON object `{"name": ..., <one of args_keys>: ...}`, or None."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    return openai_tool_call(obj["name"], args)


class StreamingParser:
    """Split generated text into content that can be streamed now and tool calls known at the end.

    Text before the first `<tool_call>` streams as it arrives, except a tail that could still begin
    `<tool_call>` (held back until the next delta decides it). From the first `<tool_call>` on,
    nothing streams; `finish` parses the whole text. What streamed is always a prefix of the final
    content, so the rest of the content can be sent with the tool calls at the end.
    """

    def __init__(self, template: ChatTemplate = SMOLLM2) -> None:
        self.template = template
        self.text = ""
        self.streamed = 0  # characters of `text` already released as content
        self.blocked = False  # a tool call may have started: hold everything from here

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that can be sent now."""
        self.text += delta
        if self.blocked:
            return ""
        opener = self.template.tool_call_open
        at = self.text.find(opener, self.streamed)
        if at >= 0:
            self.blocked = True
            out, self.streamed = self.text[self.streamed : at], at
            return out
        safe = len(self.text)
        # hold back a tail that may still become `<tool_call>`, or the end-of-turn marker that
        # `parse_completion` strips from the very end
        for marker, longest in ((opener, len(opener) - 1), (self.template.im_end, len(self.template.im_end))):
            for k in range(min(longest, len(self.text)), 0, -1):
                if self.text.endswith(marker[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        out, self.streamed = self.text[self.streamed : safe], max(self.streamed, safe)
        return out

    def finish(self, final_text: str | None = None) -> tuple[ParsedCompletion, str]:
        """The parsed completion and the content not streamed yet (`final_text` replaces the
        accumulated text when the engine trimmed it, e.g. at a stop string)."""
        text = self.text if final_text is None else final_text
        parsed = parse_completion(text, self.template)
        sent = self.text[: self.streamed]
        if not parsed.content.startswith(sent):  # cannot happen with the rules above; never lose text
            raise ValueError("streamed content is not a prefix of the final content")
        return parsed, parsed.content[len(sent) :]
