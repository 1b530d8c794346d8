"""The OpenAI chat-completions face: request validation and translation, as pure functions.

The gateway forwards a validated request to the engine with the token-ID extensions switched on
(`return_token_ids`, `logprobs`), records what came back, and hands the harness a standard answer.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harnessrl.chat import parse_completion
from harnessrl.schema import SamplingOverrides

_TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Loose):
    """One message; extra keys that SDKs echo back (refusal, annotations, audio...) are allowed."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDef(BaseModel):
    """A function a tool exposes."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of type 'object'")
        return v


class Tool(BaseModel):
    """A tool offered to the model."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(BaseModel):
    """A chat-completions request. Fields OpenAI documents but the gateway does not use are accepted
    and ignored; anything else is an error, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool | None = None
    # accepted, not used by the gateway
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("streaming is not supported on this endpoint yet; send stream=false")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 8:
            raise ValueError("at most 8 stop sequences")
        return v


def upstream_request(
    req: ChatCompletionRequest,
    served_model: str,
    sampling: SamplingOverrides,
    default_max_tokens: int,
) -> dict[str, Any]:
    """The body sent to the engine: the harness's request, the rollout's sampling overrides applied,
    and the token-ID extensions (`return_token_ids`, `logprobs`) switched on."""
    body: dict[str, Any] = {
        "model": served_model,
        "messages": [m.model_dump(exclude_none=True) for m in req.messages],
        "return_token_ids": True,
        "logprobs": True,
    }
    if req.tools and req.tool_choice != "none":
        body["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
    body["max_tokens"] = sampling.max_tokens or max_tokens
    body["temperature"] = effective_temperature(req, sampling)
    top_p = sampling.top_p if sampling.top_p is not None else req.top_p
    if top_p is not None:
        body["top_p"] = top_p
    seed = sampling.seed if sampling.seed is not None else req.seed
    if seed is not None:
        body["seed"] = seed
    if req.stop is not None:
        body["stop"] = req.stop
    if req.top_logprobs:
        body["top_logprobs"] = req.top_logprobs
    return body


def effective_temperature(req: ChatCompletionRequest, sampling: SamplingOverrides) -> float:
    """The temperature the engine samples at (OpenAI's default is 1.0)."""
    if sampling.temperature is not None:
        return sampling.temperature
    return 1.0 if req.temperature is None else req.temperature


@dataclass(frozen=True)
class TokenRecord:
    """What the engine says it consumed and produced."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    weight_version: int | None


class BadUpstreamResponse(ValueError):
    """The engine's answer lacks the token IDs or logprobs the gateway must record."""


def token_record(resp: dict[str, Any]) -> TokenRecord:
    """Read `prompt_token_ids`, `choices[0].token_ids` and the logprobs from an engine answer."""
    try:
        choice = resp["choices"][0]
        prompt_ids = [int(t) for t in resp["prompt_token_ids"]]
        completion_ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BadUpstreamResponse(f"engine answer lacks token ids or logprobs: {e!r}") from e
    if len(logprobs) != len(completion_ids):
        raise BadUpstreamResponse(
            f"engine sent {len(completion_ids)} completion tokens but {len(logprobs)} logprobs"
        )
    version = resp.get("weight_version")
    return TokenRecord(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        weight_version=int(version) if isinstance(version, int) else None,
    )


def client_response(resp: dict[str, Any], req: ChatCompletionRequest) -> dict[str, Any]:
    """The answer the harness gets: the engine's, with the extensions it did not ask for removed."""
    out = copy.deepcopy(resp)
    out["model"] = req.model
    keep_ids = bool(req.return_token_ids)
    if not keep_ids:
        out.pop("prompt_token_ids", None)
    out.pop("weight_version", None)
    for choice in out.get("choices", []):
        if not keep_ids:
            choice.pop("token_ids", None)
        if not req.logprobs:
            choice["logprobs"] = None
    return out


# token in, token out ---------------------------------------------------------------------------------
def tito_upstream_request(
    req: ChatCompletionRequest,
    served_model: str,
    sampling: SamplingOverrides,
    default_max_tokens: int,
    prompt_ids: list[int],
    stop_token_ids: list[int],
) -> dict[str, Any]:
    """The `/v1/completions` body of a tito call: the gateway's token IDs as the prompt."""
    chat_body = upstream_request(req, served_model, sampling, default_max_tokens)
    body: dict[str, Any] = {
        "model": served_model,
        "prompt": prompt_ids,
        "max_tokens": chat_body["max_tokens"],
        "temperature": chat_body["temperature"],
        "stop_token_ids": stop_token_ids,
        "return_token_ids": True,
        "logprobs": req.top_logprobs or 1,
    }
    for key in ("top_p", "seed", "stop"):
        if key in chat_body:
            body[key] = chat_body[key]
    return body


def completion_token_record(resp: dict[str, Any]) -> TokenRecord:
    """Read token IDs and logprobs from an engine's `/v1/completions` answer."""
    try:
        choice = resp["choices"][0]
        prompt_ids = [int(t) for t in resp["prompt_token_ids"]]
        completion_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        text = choice["text"]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BadUpstreamResponse(f"engine answer lacks token ids, text or logprobs: {e!r}") from e
    if not isinstance(text, str) or len(logprobs) != len(completion_ids):
        raise BadUpstreamResponse(
            f"engine sent {len(completion_ids)} completion tokens but {len(logprobs)} logprobs"
        )
    version = resp.get("weight_version")
    return TokenRecord(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        weight_version=int(version) if isinstance(version, int) else None,
    )


def chat_from_completion(
    resp: dict[str, Any], req: ChatCompletionRequest, record: TokenRecord
) -> dict[str, Any]:
    """The chat-completions answer for a tito call: the engine's text parsed into content + tool calls."""
    choice = resp["choices"][0]
    parsed = parse_completion(choice["text"])
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    finish = record.finish_reason or "stop"
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
        message["content"] = parsed.content or None
        finish = "tool_calls"
    out: dict[str, Any] = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": len(record.prompt_ids),
            "completion_tokens": len(record.completion_ids),
            "total_tokens": len(record.prompt_ids) + len(record.completion_ids),
        },
    }
    if req.logprobs:
        tokens = (choice.get("logprobs") or {}).get("tokens") or []
        out["choices"][0]["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, record.completion_logprobs, strict=False)
            ]
        }
    if req.return_token_ids:
        out["prompt_token_ids"] = record.prompt_ids
        out["choices"][0]["token_ids"] = record.completion_ids
    return out
