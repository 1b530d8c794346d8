"""The OpenAI chat-completions face: request validation and translation, as pure functions.

A validated request becomes a canonical `ChatCall`; a `Generation` becomes a `chat.completion`
object or, for `stream: true`, the `chat.completion.chunk` server-sent events OpenAI clients expect.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harnessrl.gateway.canonical import ChatCall, Generation
from harnessrl.gateway.errors import validate
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces.fields import ignored_fields, notes
from harnessrl.gateway.faces.tools import ToolMap, chat_tools
from harnessrl.gateway.history import History


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Loose):
    """One message; extra keys that SDKs echo back (refusal, annotations, audio...) are allowed."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


# the fields generation uses; any other field is accepted, ignored and reported
USED_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                         "max_completion_tokens", "stop", "seed", "n", "stream", "stream_options", "logprobs",
                         "top_logprobs", "return_token_ids", "chat_template_kwargs"})  # fmt: skip


class ChatCompletionRequest(BaseModel):
    """A chat-completions request. Fields the gateway does not use (OpenAI's or anyone's) are accepted,
    ignored and reported; a malformed value of a field it uses is a 400 naming the field."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: e.g. {"enable_thinking": false}
    # Set by `parse_request`: plain slots, not pydantic private attributes (those cost a setup per
    # request and a `__getattr__` per read, on every call's path).
    __slots__ = ("_ignored", "_tool_map")
    if TYPE_CHECKING:
        _tool_map: ToolMap
        _ignored: list[str]

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 8:
            raise ValueError("at most 8 stop sequences")
        return v


def parse_request(body: Any) -> ChatCompletionRequest:
    """Validate a chat-completions body; map its tools and note the fields it sets that are not used."""
    req = validate(ChatCompletionRequest, body)
    req._tool_map = chat_tools(req.tools)
    req._ignored = ignored_fields(body, USED_FIELDS)
    return req


def to_chat_call(req: ChatCompletionRequest) -> ChatCall:
    """The canonical call of a chat-completions request."""
    tools = None
    if req._tool_map.functions and req.tool_choice != "none":
        tools = req._tool_map.functions
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return ChatCall(
        model=req.model,
        messages=[m.model_dump(exclude_none=True) for m in req.messages],
        tools=tools,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=stop,
        top_logprobs=req.top_logprobs or 0,
        template_kwargs=req.chat_template_kwargs or None,
    )


def _logprobs(gen: Generation) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(gen.token_texts, gen.record.completion_logprobs, strict=False)
        ]
    }


def chat_response(
    gen: Generation, req: ChatCompletionRequest, response_id: str, created: int
) -> dict[str, Any]:
    """The `chat.completion` object for a generation."""
    prompt_tokens, completion_tokens = gen.usage
    choice: dict[str, Any] = {
        "index": 0,
        "message": gen.answer_message(),
        "logprobs": _logprobs(gen) if req.logprobs else None,
        "finish_reason": gen.finish_reason,
    }
    out: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if gen.cached_tokens is not None:
        out["usage"]["prompt_tokens_details"] = {"cached_tokens": gen.cached_tokens}
    if req.return_token_ids:
        out["prompt_token_ids"] = gen.record.prompt_ids
        choice["token_ids"] = gen.record.completion_ids
    return out


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ChatStreamer:
    """`chat.completion.chunk` events: role, content as it comes, tool calls and finish at the end."""

    def __init__(self, req: ChatCompletionRequest, ids: ResponseIds) -> None:
        self.req = req
        self.base = {"id": f"chatcmpl-{ids.response_id}", "object": "chat.completion.chunk",
                     "created": ids.created, "model": req.model}  # fmt: skip
        self.reasoning_sent = ""

    def start(self) -> list[str]:
        """The role chunk."""
        return [_data(_chunk(self.base, {"role": "assistant", "content": ""}))]

    def delta(self, text: str) -> list[str]:
        """A content chunk."""
        return [_data(_chunk(self.base, {"content": text}))]

    def reasoning(self, text: str) -> list[str]:
        """A `reasoning_content` chunk."""
        self.reasoning_sent += text
        return [_data(_chunk(self.base, {"reasoning_content": text}))]

    def end(self, gen: Generation, out: dict[str, Any]) -> list[str]:
        """The reasoning not streamed yet, tool-call chunks, the finish chunk, usage if asked, `[DONE]`."""
        rest = (gen.reasoning or "")[len(self.reasoning_sent) :]
        frames = self.reasoning(rest) if rest else []
        for i, tc in enumerate(gen.tool_calls):
            fn = tc["function"]
            head = {
                "index": i,
                "id": tc["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            frames.append(_data(_chunk(self.base, {"tool_calls": [head]})))
            frames.append(
                _data(
                    _chunk(
                        self.base, {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}
                    )
                )
            )
        last = _chunk(self.base, {}, gen.finish_reason)
        if self.req.return_token_ids:
            last["prompt_token_ids"] = gen.record.prompt_ids
            last["choices"][0]["token_ids"] = gen.record.completion_ids
        frames.append(_data(last))
        if (self.req.stream_options or {}).get("include_usage"):
            frames.append(_data({**self.base, "choices": [], "usage": out["usage"]}))
        return [*frames, "data: [DONE]\n\n"]

    def error(self, message: str) -> list[str]:
        """An error event in place of the rest of the stream."""
        return [_data({"error": {"message": message, "type": "upstream_error", "param": None, "code": None}}),
                "data: [DONE]\n\n"]  # fmt: skip


class OpenAIChatFace:
    """`POST /v1/chat/completions`."""

    name = "openai.chat"
    error_style = "openai"

    def parse(self, body: Any) -> ChatCompletionRequest:
        """Validate a chat-completions body."""
        return parse_request(body)

    def to_chat_call(self, req: ChatCompletionRequest, history: History) -> ChatCall:
        """The canonical call."""
        return to_chat_call(req)

    def render(self, gen: Generation, req: ChatCompletionRequest, ids: ResponseIds) -> dict[str, Any]:
        """The `chat.completion` object."""
        return chat_response(gen, req, f"chatcmpl-{ids.response_id}", ids.created)

    def streamer(self, req: ChatCompletionRequest, ids: ResponseIds) -> ChatStreamer | None:
        """The event writer when `stream: true`."""
        return ChatStreamer(req, ids) if req.stream else None

    def describe(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """Ignored fields and dropped tools."""
        return notes(req._ignored, req._tool_map.dropped)
