"""The Anthropic messages face: `POST /v1/messages`, non-streaming and streaming. Pure translation.

Request → canonical: `system` becomes a system message, and so does a `system` turn inside `messages`
(at its place); a user turn's `tool_result` blocks become `tool` messages (in order, before the turn's
text); an assistant turn's `tool_use` blocks become `tool_calls` (thinking and server-tool blocks are
skipped); blocks the model cannot see (images, documents) become placeholders such as `[image]`.
Tools are mapped by `faces.tools.anthropic_tools` (server tools dropped, client tools given their
schema, deferred tools loaded by `tool_reference`). Fields with no meaning here (`thinking`,
`context_management`, `output_config`, `metadata`, `top_k`, ...) are ignored and reported.
Answer: a `text` block (if any text) and one `tool_use` block per tool call; `stop_reason` is
`tool_use`, `max_tokens` or `end_turn`. Streaming follows Anthropic's event sequence: message_start,
content_block_start/delta/stop per block, message_delta, message_stop.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.gateway.canonical import ChatCall, Generation
from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces.fields import ignored_fields, notes, part_text
from harnessrl.gateway.faces.tools import ToolMap, anthropic_tools
from harnessrl.gateway.history import History

# the fields generation uses; any other field is accepted, ignored and reported
USED_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                         "temperature", "top_p", "stream"})  # fmt: skip


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    """One turn: a string or a list of content blocks (a `system` turn carries system text)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[_Block]


class MessagesRequest(BaseModel):
    """A `/v1/messages` request. Fields the gateway does not use are accepted, ignored and reported."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[_Block] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=8)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    __slots__ = ("_ignored", "_tool_map")  # set by `parse_request` (see openai_chat.ChatCompletionRequest)
    if TYPE_CHECKING:
        _tool_map: ToolMap
        _ignored: list[str]


class CountTokensRequest(MessagesRequest):
    """A `/v1/messages/count_tokens` request: a messages request without `max_tokens`."""

    max_tokens: int = Field(default=1, ge=1)


def _text(blocks: str | list[_Block] | None, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks):
        text = getattr(b, "text", None)
        if b.type != "text" or not isinstance(text, str):
            raise APIError(400, f"{where}.{i}: only text blocks are supported here", param=f"{where}.{i}")
        parts.append(text)
    return "".join(parts)


def _block_text(block: Any, where: str) -> str:
    """A block the model sees as text: text itself, a loaded tool's name, or a placeholder."""
    data = block.model_dump() if isinstance(block, BaseModel) else block
    kind = data.get("type") if isinstance(data, dict) else None
    if kind in ("image", "document") and not isinstance(data.get("source"), dict):
        raise APIError(400, f"{where}: an {kind} block needs a 'source' object", param=f"{where}.source")
    if kind == "tool_reference" and isinstance(data.get("tool_name"), str):
        return f"[tool loaded: {data['tool_name']}]"
    return part_text(data, where)


def _tool_result_text(block: _Block, where: str) -> str:
    content = getattr(block, "content", "")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(_block_text(c, f"{where}.content.{k}") for k, c in enumerate(content))
    raise APIError(400, f"{where}.content must be a string or a list of blocks", param=f"{where}.content")


def _user_turn(msg: AnthropicMessage, i: int) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(msg.content):
        where = f"messages.{i}.content.{j}"
        if b.type == "tool_result":
            tool_use_id = getattr(b, "tool_use_id", None)
            if not isinstance(tool_use_id, str):
                raise APIError(400, f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(b, where)})
        else:
            texts.append(_block_text(b, where))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_turn(msg: AnthropicMessage, i: int) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    texts, calls = [], []
    for j, b in enumerate(msg.content):
        where = f"messages.{i}.content.{j}"
        if b.type == "text" and isinstance(getattr(b, "text", None), str):
            texts.append(b.text)  # type: ignore[attr-defined]
        elif b.type == "tool_use":
            name, args, call_id = getattr(b, "name", None), getattr(b, "input", None), getattr(b, "id", None)
            if not isinstance(name, str) or not isinstance(args, dict) or not isinstance(call_id, str):
                raise APIError(
                    400, f"{where}: tool_use needs string id and name and an object input", param=where
                )
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            )
        # thinking, redacted_thinking and server-tool blocks (server_tool_use, *_tool_result) carry
        # nothing the model here wrote or can use: skipped
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
        out["content"] = out["content"] or None
    return out


def _loaded_tools(messages: list[AnthropicMessage]) -> set[str]:
    """Names of deferred tools that `tool_reference` blocks (inside tool results) have loaded."""
    names: set[str] = set()
    for m in messages:
        for b in m.content if isinstance(m.content, list) else []:
            content = getattr(b, "content", None) if b.type == "tool_result" else None
            for c in content if isinstance(content, list) else []:
                if (
                    isinstance(c, dict)
                    and c.get("type") == "tool_reference"
                    and isinstance(c.get("tool_name"), str)
                ):
                    names.add(c["tool_name"])
    return names


def parse_request(body: Any, model: type[MessagesRequest] = MessagesRequest) -> MessagesRequest:
    """Validate a messages body; map its tools and note the fields it sets that are not used."""
    req = validate(model, body)
    req._tool_map = anthropic_tools(req.tools, _loaded_tools(req.messages))
    req._ignored = ignored_fields(body, USED_FIELDS)
    return req


def to_chat_call(req: MessagesRequest) -> ChatCall:
    """The canonical call of a messages request."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if m.role == "user":
            messages += _user_turn(m, i)
        elif m.role == "system":
            messages.append({"role": "system", "content": _text(m.content, f"messages.{i}.content")})
        else:
            messages.append(_assistant_turn(m, i))
    tools = None
    if req._tool_map.functions and (req.tool_choice or {}).get("type") != "none":
        tools = req._tool_map.functions
    return ChatCall(
        model=req.model, messages=messages, tools=tools, max_tokens=req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, stop=req.stop_sequences,
    )  # fmt: skip


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def content_blocks(gen: Generation) -> list[dict[str, Any]]:
    """The answer's content blocks: thinking (a reasoning model's), text (if any), then tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if gen.reasoning:  # no signature: the thinking is the served model's own text, not Anthropic's
        blocks.append({"type": "thinking", "thinking": gen.reasoning, "signature": ""})
    if gen.content or not gen.tool_calls:
        blocks.append({"type": "text", "text": gen.content})
    for tc in gen.tool_calls:
        fn = tc["function"]
        blocks.append(
            {"type": "tool_use", "id": tc["id"], "name": fn["name"], "input": _tool_input(fn["arguments"])}
        )
    return blocks


def stop_reason(gen: Generation, requested_max: int | None = None) -> str:
    """Anthropic's stop reason for a generation. A reply cut by length before the request's own
    `max_tokens` was cut by the gateway (the budget clamped to the context, or the rollout's cap):
    `model_context_window_exceeded`, which clients tell apart from their own output maximum."""
    if gen.tool_calls:
        return "tool_use"
    if gen.finish_reason != "length":
        return "end_turn"
    if requested_max is not None and len(gen.record.completion_ids) < requested_max:
        return "model_context_window_exceeded"
    return "max_tokens"


def usage(gen: Generation) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` counts the prompt tokens *not* read from a cache, so the
    engine's prefix-cache hits are `cache_read_input_tokens` and the two add up to the prompt (the
    engine's cache is automatic: nothing is ever written on request, `cache_creation_input_tokens` 0)."""
    prompt_tokens, completion_tokens = gen.usage
    cached = min(gen.cached_tokens or 0, prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def message_response(gen: Generation, req: MessagesRequest, ids: ResponseIds) -> dict[str, Any]:
    """The `message` object."""
    return {
        "id": f"msg_{ids.response_id}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content_blocks(gen),
        "stop_reason": stop_reason(gen, req.max_tokens),
        "stop_sequence": None,
        "usage": usage(gen),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class MessageStreamer:
    """Anthropic's event sequence: message_start, a thinking block as a reasoning model thinks, a text
    block as content comes, tool_use blocks, message_delta with the stop reason and usage, message_stop."""

    def __init__(self, req: MessagesRequest, ids: ResponseIds) -> None:
        self.req, self.ids = req, ids
        self.open: str | None = None  # the kind of the content block open now
        self.blocks = 0  # content blocks started so far (the next one's index)
        self.thinking_sent = ""
        self.text_sent = False

    def start(self) -> list[str]:
        """message_start."""
        message: dict[str, Any] = {"id": f"msg_{self.ids.response_id}", "type": "message", "role": "assistant", "model": self.req.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _switch(self, kind: str, block: dict[str, Any]) -> list[str]:
        """Close the open block unless it is of `kind`, and open `block` in its place."""
        if self.open == kind:
            return []
        frames = self._close()
        self.open, self.blocks = kind, self.blocks + 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [*frames, _event("content_block_start", start)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
        )

    def reasoning(self, text: str) -> list[str]:
        """A thinking_delta (opening the thinking block first; no signature: the served model's own text)."""
        self.thinking_sent += text
        frames = self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return [*frames, self._delta({"type": "thinking_delta", "thinking": text})]

    def delta(self, text: str) -> list[str]:
        """A text_delta (closing the thinking block and opening the text block first)."""
        frames = self._switch("text", {"type": "text", "text": ""})
        self.text_sent = True
        return [*frames, self._delta({"type": "text_delta", "text": text})]

    def end(self, gen: Generation, out: dict[str, Any]) -> list[str]:
        """The thinking not streamed yet, the (empty) text block where the answer has one and none was
        sent, tool_use blocks, then message_delta and message_stop."""
        frames = []
        if rest := (gen.reasoning or "")[len(self.thinking_sent) :]:
            frames += self.reasoning(rest)
        if not gen.tool_calls and not self.text_sent:
            frames += self.delta("")
        frames += self._close()
        for block in (b for b in out["content"] if b["type"] == "tool_use"):
            head = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            frames += self._switch("tool_use", head)
            frames.append(
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            )
            frames += self._close()
        frames.append(_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": out["stop_reason"], "stop_sequence": None},
            "usage": dict(out["usage"]),
        }))  # fmt: skip
        return [*frames, _event("message_stop", {"type": "message_stop"})]

    def error(self, message: str) -> list[str]:
        """An error event."""
        return [_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})]


class AnthropicFace:
    """`POST /v1/messages`."""

    name = "anthropic.messages"
    error_style = "anthropic"

    def parse(self, body: Any) -> MessagesRequest:
        """Validate a messages body."""
        return parse_request(body)

    def to_chat_call(self, req: MessagesRequest, history: History) -> ChatCall:
        """The canonical call."""
        return to_chat_call(req)

    def render(self, gen: Generation, req: MessagesRequest, ids: ResponseIds) -> dict[str, Any]:
        """The `message` object."""
        return message_response(gen, req, ids)

    def streamer(self, req: MessagesRequest, ids: ResponseIds) -> MessageStreamer | None:
        """The event writer when `stream: true`."""
        return MessageStreamer(req, ids) if req.stream else None

    def describe(self, req: MessagesRequest) -> dict[str, Any]:
        """Ignored fields and dropped tools."""
        return notes(req._ignored, req._tool_map.dropped)
