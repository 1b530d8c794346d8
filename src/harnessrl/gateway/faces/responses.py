"""The OpenAI Responses face: `POST /v1/responses` with function tools, `previous_response_id`,
non-streaming and streaming. Pure translation.

Input items → canonical: `instructions` becomes the system message; message items keep their role;
consecutive `function_call` items join the assistant message they follow (as its `tool_calls`);
`function_call_output` items become `tool` messages; reasoning items are skipped. With
`previous_response_id`, the conversation continues from that response of the same rollout (its
messages and its answer), as the stateful API does. Output: a `message` item (if there is text or no
tool call) and one `function_call` item per tool call.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.chat import ChatFormatError, content_text
from harnessrl.gateway.canonical import ChatCall, Generation
from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.history import History


class FunctionTool(BaseModel):
    """A function tool (the only tool type a local model can serve)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """A `/v1/responses` request; documented fields the gateway does not use are accepted and ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # accepted, not used
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None


def _item_text(content: Any, where: str) -> str:
    try:
        return content_text(content, where=where)
    except ChatFormatError as e:
        raise APIError(400, str(e), param=where) from None


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
        raise APIError(400, f"{where}: function_call needs string call_id, name and arguments", param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def items_to_messages(items: list[dict[str, Any]], offset: int = 0) -> list[dict[str, Any]]:
    """Canonical chat messages of Responses input items."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{offset + i}"
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            role = item["role"]
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"{where}.role '{role}' is not supported", param=f"{where}.role")
            out.append({"role": role, "content": _item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _item_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input item type '{kind}' is not supported", param=f"{where}.type")
    return out


def _previous(history: History, response_id: str) -> list[dict[str, Any]]:
    recent = history.recent()
    found = [c for c in recent if (c.response or {}).get("id") == response_id]
    for call in reversed(found or history.all()):
        if call.face == "openai.responses" and (call.response or {}).get("id") == response_id:
            messages, _, answer = call.conversation()
            base = messages[1:] if messages and messages[0].get("role") == "system" else messages
            return [*base, answer] if answer is not None else base
    raise APIError(
        404,
        f"previous_response_id '{response_id}' is not a response of this rollout",
        param="previous_response_id",
    )


def to_chat_call(req: ResponsesRequest, history: History) -> ChatCall:
    """The canonical call of a Responses request (resolving `previous_response_id` in `history`)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages = _previous(history, req.previous_response_id) if req.previous_response_id else []
    messages = messages + items_to_messages(items)
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise APIError(400, "input: at least one input item is needed", param="input")
    tools = None
    if req.tools and req.tool_choice != "none":
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.parameters or {"type": "object"}}}
                 for t in req.tools]  # fmt: skip
    return ChatCall(
        model=req.model, messages=messages, tools=tools, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs or 0,
    )  # fmt: skip


def output_items(gen: Generation, ids: ResponseIds) -> list[dict[str, Any]]:
    """The response's output items: a message (text), then one function_call item per tool call."""
    items: list[dict[str, Any]] = []
    if gen.content or not gen.tool_calls:
        part = {"type": "output_text", "text": gen.content, "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": f"msg_{ids.response_id}", "status": "completed",
                      "role": "assistant", "content": [part]})  # fmt: skip
    for i, tc in enumerate(gen.tool_calls):
        fn = tc["function"]
        items.append({"type": "function_call", "id": f"fc_{ids.response_id}_{i}", "call_id": tc["id"],
                      "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})  # fmt: skip
    return items


def response_object(gen: Generation, req: ResponsesRequest, ids: ResponseIds) -> dict[str, Any]:
    """The `response` object."""
    prompt_tokens, completion_tokens = gen.usage
    incomplete = gen.finish_reason == "length" and not gen.tool_calls
    return {
        "id": f"resp_{ids.response_id}",
        "object": "response",
        "created_at": ids.created,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": req.model,
        "instructions": req.instructions,
        "output": output_items(gen, ids),
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "metadata": req.metadata or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class ResponseStreamer:
    """Responses streaming events, numbered: created, in_progress, the message item as text comes,
    function_call items, then completed (or incomplete)."""

    def __init__(self, req: ResponsesRequest, ids: ResponseIds) -> None:
        self.req, self.ids = req, ids
        self.seq = 0
        self.text = ""
        self.open = False
        self.item_id = f"msg_{ids.response_id}"

    def _ev(self, kind: str, **data: Any) -> str:
        frame = f"event: {kind}\ndata: {json.dumps({'type': kind, **data, 'sequence_number': self.seq})}\n\n"
        self.seq += 1
        return frame

    def start(self) -> list[str]:
        """response.created and response.in_progress."""
        pending = {"id": f"resp_{self.ids.response_id}", "object": "response", "created_at": self.ids.created,
                   "status": "in_progress", "model": self.req.model, "output": [], "parallel_tool_calls": True,
                   "tool_choice": self.req.tool_choice or "auto", "tools": [], "error": None,
                   "incomplete_details": None, "instructions": self.req.instructions, "metadata": {}}  # fmt: skip
        return [
            self._ev("response.created", response=pending),
            self._ev("response.in_progress", response=pending),
        ]

    def delta(self, text: str) -> list[str]:
        """output_text.delta (opening the message item first)."""
        frames = []
        ref = {"item_id": self.item_id, "output_index": 0}
        if not self.open:
            self.open = True
            item = {
                "type": "message",
                "id": self.item_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames += [self._ev("response.output_item.added", output_index=0, item=item),
                       self._ev("response.content_part.added", **ref, content_index=0, part=part)]  # fmt: skip
        self.text += text
        return [
            *frames,
            self._ev("response.output_text.delta", **ref, content_index=0, delta=text, logprobs=[]),
        ]

    def end(self, gen: Generation, out: dict[str, Any]) -> list[str]:
        """Close the message item, emit function_call items, then the final response."""
        frames = []
        items = out["output"]
        if items and items[0]["type"] == "message":
            if not self.open:
                frames += self.delta("")
            ref = {"item_id": self.item_id, "output_index": 0}
            part = items[0]["content"][0]
            frames += [self._ev("response.output_text.done", **ref, content_index=0, text=part["text"], logprobs=[]),
                       self._ev("response.content_part.done", **ref, content_index=0, part=part),
                       self._ev("response.output_item.done", output_index=0, item=items[0])]  # fmt: skip
        for i, item in enumerate(items):
            if item["type"] != "function_call":
                continue
            ref = {"item_id": item["id"], "output_index": i}
            frames += [
                self._ev(
                    "response.output_item.added",
                    output_index=i,
                    item={**item, "status": "in_progress", "arguments": ""},
                ),
                self._ev("response.function_call_arguments.delta", **ref, delta=item["arguments"]),
                self._ev(
                    "response.function_call_arguments.done",
                    **ref,
                    arguments=item["arguments"],
                    name=item["name"],
                ),
                self._ev("response.output_item.done", output_index=i, item=item),
            ]
        done = "response.completed" if out["status"] == "completed" else "response.incomplete"
        return [*frames, self._ev(done, response=out)]

    def error(self, message: str) -> list[str]:
        """An error event."""
        return [self._ev("error", code="upstream_error", message=message, param=None)]


class ResponsesFace:
    """`POST /v1/responses`."""

    name = "openai.responses"
    error_style = "openai"

    def parse(self, body: Any) -> ResponsesRequest:
        """Validate a Responses body (only function tools are accepted)."""
        if isinstance(body, dict) and isinstance(body.get("tools"), list):
            for i, tool in enumerate(body["tools"]):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise APIError(400, f"tools.{i}: only function tools are supported, not '{tool.get('type')}'",
                                   param=f"tools.{i}.type")  # fmt: skip
        return validate(ResponsesRequest, body)

    def to_chat_call(self, req: ResponsesRequest, history: History) -> ChatCall:
        """The canonical call."""
        return to_chat_call(req, history)

    def render(self, gen: Generation, req: ResponsesRequest, ids: ResponseIds) -> dict[str, Any]:
        """The `response` object."""
        return response_object(gen, req, ids)

    def streamer(self, req: ResponsesRequest, ids: ResponseIds) -> ResponseStreamer | None:
        """The event writer when `stream: true`."""
        return ResponseStreamer(req, ids) if req.stream else None
