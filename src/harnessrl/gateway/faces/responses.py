"""The OpenAI Responses face: `POST /v1/responses` with tools of every kind, `previous_response_id`,
non-streaming and streaming. Pure translation.

Input items → canonical: `instructions` becomes the system message; message items keep their role;
consecutive tool-call items (`function_call`, with its `namespace` if any, `custom_tool_call`,
`local_shell_call`, `computer_call`, `tool_search_call`) join the assistant message they follow (as its
`tool_calls`); their `*_output` items become `tool` messages; reasoning items and items of hosted
tools are skipped (and reported). With `previous_response_id`, the conversation continues from that
response of the same rollout (its messages and its answer), as the stateful API does. Tools are mapped
by `faces.tools.responses_tools`; the answer maps the model's calls back: a message item (if there is
text or no tool call), then one item per call in the shape of the tool it called.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.gateway.canonical import ChatCall, Generation
from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces.fields import ignored_fields, lenient_content_text, notes
from harnessrl.gateway.faces.tools import ToolMap, arguments_object, custom_input, flat_name, responses_tools
from harnessrl.gateway.history import History

# the fields generation uses; any other field is accepted, ignored and reported
USED_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
                         "temperature", "top_p", "stream", "previous_response_id", "top_logprobs"})  # fmt: skip
CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call", "computer_call", "tool_search_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output",
                "computer_call_output", "tool_search_output")  # fmt: skip


class ResponsesRequest(BaseModel):
    """A `/v1/responses` request. Fields the gateway does not use are accepted, ignored and reported."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    previous_response_id: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # set by `parse_request` (see openai_chat.ChatCompletionRequest)
    __slots__ = ("_ignored", "_messages", "_skipped", "_tool_map")
    if TYPE_CHECKING:
        _tool_map: ToolMap
        _messages: list[dict[str, Any]]
        _ignored: list[str]
        _skipped: list[str]

    def extra(self, name: str) -> Any:
        """A field the gateway does not use (echoed in the answer where the API echoes it)."""
        return (self.model_extra or {}).get(name)


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The canonical tool call of a tool-call input item."""
    kind, call_id = item["type"], item.get("call_id") or item.get("id")
    if not isinstance(call_id, str):
        raise APIError(400, f"{where}: {kind} needs a string call_id", param=f"{where}.call_id")
    namespace = item.get("namespace") if isinstance(item.get("namespace"), str) else None
    if kind == "function_call":
        name, args = item.get("name"), item.get("arguments")
        if not isinstance(name, str) or not isinstance(args, str):
            raise APIError(400, f"{where}: function_call needs string name and arguments", param=where)
    elif kind == "custom_tool_call":
        name, text = item.get("name"), item.get("input")
        if not isinstance(name, str) or not isinstance(text, str):
            raise APIError(400, f"{where}: custom_tool_call needs string name and input", param=where)
        args = json.dumps({"input": text}, ensure_ascii=False)
    elif kind == "local_shell_call":
        action = item.get("action")
        fields = {k: v for k, v in action.items() if k != "type"} if isinstance(action, dict) else {}
        name, args = "local_shell", json.dumps(fields)
    elif kind == "computer_call":
        name, args = "computer", json.dumps({"action": item.get("action")})
    else:  # tool_search_call
        raw = item.get("arguments")
        name, args = "tool_search", raw if isinstance(raw, str) else json.dumps(raw or {})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": flat_name(namespace, name), "arguments": args},
    }


def _output_text(item: dict[str, Any], where: str) -> str:
    if item["type"] == "tool_search_output":
        names = [str(t.get("name") or t.get("type")) for t in item.get("tools") or [] if isinstance(t, dict)]
        return "Tools loaded: " + ", ".join(names) if names else "No tools found."
    output = item.get("output")
    if isinstance(output, dict):
        return lenient_content_text([output], f"{where}.output")
    return lenient_content_text(output, f"{where}.output")


def items_to_messages(items: list[dict[str, Any]], offset: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """Canonical chat messages of Responses input items, and the types of the items skipped."""
    out: list[dict[str, Any]] = []
    skipped: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{offset + i}"
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            role = item["role"]
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"{where}.role '{role}' is not supported", param=f"{where}.role")
            out.append(
                {"role": role, "content": lenient_content_text(item.get("content"), f"{where}.content")}
            )
        elif kind in CALL_ITEMS:
            call = _call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in OUTPUT_ITEMS:
            call_id = item.get("call_id") or item.get("id")
            out.append(
                {"role": "tool", "tool_call_id": str(call_id or ""), "content": _output_text(item, where)}
            )
        else:
            skipped.append(str(kind))
    return out, skipped


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


def parse_request(body: Any) -> ResponsesRequest:
    """Validate a Responses body: its input items as canonical messages, its tools mapped, and the
    fields it sets that are not used."""
    req = validate(ResponsesRequest, body)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    req._messages, skipped = items_to_messages(items)
    req._skipped = sorted(set(skipped))
    loaded = [
        t for item in items if item.get("type") == "tool_search_output" for t in item.get("tools") or []
    ]
    req._tool_map = responses_tools([*(req.tools or []), *loaded])
    req._ignored = ignored_fields(body, USED_FIELDS)
    return req


def to_chat_call(req: ResponsesRequest, history: History) -> ChatCall:
    """The canonical call of a Responses request (resolving `previous_response_id` in `history`)."""
    messages = _previous(history, req.previous_response_id) if req.previous_response_id else []
    messages = messages + req._messages
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    if not messages:
        raise APIError(400, "input: at least one input item is needed", param="input")
    tools = None
    if req._tool_map.functions and req.tool_choice != "none":
        tools = req._tool_map.functions
    return ChatCall(
        model=req.model, messages=messages, tools=tools, max_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs or 0,
    )  # fmt: skip


def call_item(tc: dict[str, Any], tools: ToolMap, item_id: str) -> dict[str, Any]:
    """The output item of one tool call, in the shape of the tool the model called."""
    fn = tc["function"]
    origin = tools.origin(fn["name"])
    base: dict[str, Any] = {"id": item_id, "call_id": tc["id"], "status": "completed"}
    if origin.kind == "custom":
        item = {
            "type": "custom_tool_call",
            **base,
            "name": origin.name,
            "input": custom_input(fn["arguments"]),
        }
    elif origin.kind == "local_shell":
        item = {
            "type": "local_shell_call",
            **base,
            "action": {"type": "exec", **arguments_object(fn["arguments"])},
        }
    elif origin.kind == "computer":
        args = arguments_object(fn["arguments"])
        item = {
            "type": "computer_call",
            **base,
            "action": args.get("action", args),
            "pending_safety_checks": [],
        }
    elif origin.kind == "tool_search":
        item = {
            "type": "tool_search_call",
            **base,
            "execution": "client",
            "arguments": arguments_object(fn["arguments"]),
        }
    else:
        item = {"type": "function_call", **base, "name": origin.name, "arguments": fn["arguments"]}
    if origin.namespace:
        item["namespace"] = origin.namespace
    return item


def reasoning_item(ids: ResponseIds, text: str) -> dict[str, Any]:
    """The reasoning item of a reasoning model's thinking (its text as a `reasoning_text` part)."""
    return {"type": "reasoning", "id": f"rs_{ids.response_id}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def output_items(gen: Generation, ids: ResponseIds, tools: ToolMap | None = None) -> list[dict[str, Any]]:
    """The response's output items: reasoning (a reasoning model's), a message (text), then one item per
    tool call."""
    items: list[dict[str, Any]] = []
    if gen.reasoning:
        items.append(reasoning_item(ids, gen.reasoning))
    if gen.content or not gen.tool_calls:
        part = {"type": "output_text", "text": gen.content, "annotations": [], "logprobs": []}
        items.append({"type": "message", "id": f"msg_{ids.response_id}", "status": "completed",
                      "role": "assistant", "content": [part]})  # fmt: skip
    for i, tc in enumerate(gen.tool_calls):
        items.append(call_item(tc, tools or ToolMap(), f"fc_{ids.response_id}_{i}"))
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
        "output": output_items(gen, ids, req._tool_map),
        "parallel_tool_calls": req.extra("parallel_tool_calls") is not False,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "metadata": req.extra("metadata") if isinstance(req.extra("metadata"), dict) else {},
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
    """Responses streaming events, numbered: created, in_progress, the reasoning item as a reasoning
    model thinks, the message item as text comes, function_call items, then completed (or incomplete).
    Output indices are those of the final response's `output`."""

    def __init__(self, req: ResponsesRequest, ids: ResponseIds) -> None:
        self.req, self.ids = req, ids
        self.seq = 0
        self.text = ""
        self.thinking = ""
        self.open: str | None = None  # the item open now: "reasoning" or "message"
        self.message_open = False
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

    def reasoning(self, text: str) -> list[str]:
        """reasoning_text.delta (opening the reasoning item first)."""
        frames = []
        ref = {"item_id": f"rs_{self.ids.response_id}", "output_index": 0}
        if not self.thinking:
            self.open = "reasoning"
            item = {"type": "reasoning", "id": ref["item_id"], "summary": [], "content": []}
            frames.append(self._ev("response.output_item.added", output_index=0, item=item))
        self.thinking += text
        return [*frames, self._ev("response.reasoning_text.delta", **ref, content_index=0, delta=text)]

    def _close_reasoning(self) -> list[str]:
        if self.open != "reasoning":
            return []
        self.open = None
        ref = {"item_id": f"rs_{self.ids.response_id}", "output_index": 0}
        return [self._ev("response.reasoning_text.done", **ref, content_index=0, text=self.thinking),
                self._ev("response.output_item.done", output_index=0, item=reasoning_item(self.ids, self.thinking))]  # fmt: skip

    def delta(self, text: str) -> list[str]:
        """output_text.delta (closing the reasoning item and opening the message item first)."""
        frames = self._close_reasoning()
        ref = {"item_id": self.item_id, "output_index": 1 if self.thinking else 0}
        if not self.message_open:
            self.open, self.message_open = "message", True
            item = {
                "type": "message",
                "id": self.item_id,
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames += [self._ev("response.output_item.added", output_index=ref["output_index"], item=item),
                       self._ev("response.content_part.added", **ref, content_index=0, part=part)]  # fmt: skip
        self.text += text
        return [
            *frames,
            self._ev("response.output_text.delta", **ref, content_index=0, delta=text, logprobs=[]),
        ]

    def end(self, gen: Generation, out: dict[str, Any]) -> list[str]:
        """The reasoning not streamed yet, the message item closed, the tool-call items, then the final response."""
        frames = []
        if rest := (gen.reasoning or "")[len(self.thinking) :]:
            frames += self.reasoning(rest)
        frames += self._close_reasoning()
        for i, item in enumerate(out["output"]):
            if item["type"] == "message":
                if not self.message_open:
                    frames += self.delta("")
                ref = {"item_id": self.item_id, "output_index": i}
                part = item["content"][0]
                frames += [self._ev("response.output_text.done", **ref, content_index=0, text=part["text"], logprobs=[]),
                           self._ev("response.content_part.done", **ref, content_index=0, part=part),
                           self._ev("response.output_item.done", output_index=i, item=item)]  # fmt: skip
            elif item["type"] != "reasoning":
                frames += self._call_frames(i, item)
        done = "response.completed" if out["status"] == "completed" else "response.incomplete"
        return [*frames, self._ev(done, response=out)]

    def _call_frames(self, i: int, item: dict[str, Any]) -> list[str]:
        """The events of one tool-call item: added, its arguments or input (delta, done), done."""
        ref = {"item_id": item["id"], "output_index": i}
        kind = item["type"]
        if kind == "function_call":
            opening = {**item, "status": "in_progress", "arguments": ""}
            body = [self._ev("response.function_call_arguments.delta", **ref, delta=item["arguments"]),
                    self._ev("response.function_call_arguments.done", **ref, arguments=item["arguments"],
                             name=item["name"])]  # fmt: skip
        elif kind == "custom_tool_call":
            opening = {**item, "status": "in_progress", "input": ""}
            body = [self._ev("response.custom_tool_call_input.delta", **ref, delta=item["input"]),
                    self._ev("response.custom_tool_call_input.done", **ref, input=item["input"])]  # fmt: skip
        else:
            opening, body = {**item, "status": "in_progress"}, []
        return [self._ev("response.output_item.added", output_index=i, item=opening), *body,
                self._ev("response.output_item.done", output_index=i, item=item)]  # fmt: skip

    def error(self, message: str) -> list[str]:
        """An error event."""
        return [self._ev("error", code="upstream_error", message=message, param=None)]


class ResponsesFace:
    """`POST /v1/responses`."""

    name = "openai.responses"
    error_style = "openai"

    def parse(self, body: Any) -> ResponsesRequest:
        """Validate a Responses body."""
        return parse_request(body)

    def to_chat_call(self, req: ResponsesRequest, history: History) -> ChatCall:
        """The canonical call."""
        return to_chat_call(req, history)

    def render(self, gen: Generation, req: ResponsesRequest, ids: ResponseIds) -> dict[str, Any]:
        """The `response` object."""
        return response_object(gen, req, ids)

    def streamer(self, req: ResponsesRequest, ids: ResponseIds) -> ResponseStreamer | None:
        """The event writer when `stream: true`."""
        return ResponseStreamer(req, ids) if req.stream else None

    def describe(self, req: ResponsesRequest) -> dict[str, Any]:
        """Ignored fields, dropped tools and skipped input items."""
        return notes(req._ignored, req._tool_map.dropped, skipped_items=req._skipped)
