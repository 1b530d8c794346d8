"""The OpenAI completions face: `POST /v1/completions` with a text or token-ID prompt. The prompt goes
to the engine as is (no chat template), so a harness that builds its own prompts keeps full control."""

from __future__ import annotations

import copy
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harnessrl.gateway.errors import validate


class CompletionRequest(BaseModel):
    """A completions request (documented fields the gateway does not use are accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    echo: bool | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("a token-ID prompt must be a non-empty list of non-negative integers")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v


def parse(body: Any) -> CompletionRequest:
    """Validate a completions body."""
    return validate(CompletionRequest, body)


def client_response(resp: dict[str, Any], req: CompletionRequest) -> dict[str, Any]:
    """The engine's answer with the harness's model name and without extensions it did not ask for."""
    out = copy.deepcopy(resp)
    out["model"] = req.model
    out.pop("weight_version", None)
    if not req.return_token_ids:
        out.pop("prompt_token_ids", None)
        for choice in out.get("choices", []):
            choice.pop("token_ids", None)
    if req.logprobs is None:
        for choice in out.get("choices", []):
            choice["logprobs"] = None
    return out


def client_chunk(event: dict[str, Any], req: CompletionRequest) -> dict[str, Any]:
    """One engine stream event as the harness asked for it (its model name, extensions only on request)."""
    out = {k: v for k, v in event.items() if k not in ("weight_version", "usage", "prompt_token_ids")}
    out["model"] = req.model
    if req.return_token_ids and "prompt_token_ids" in event:
        out["prompt_token_ids"] = event["prompt_token_ids"]
    choices = []
    for choice in event.get("choices") or []:
        c = {k: v for k, v in choice.items() if k != "token_ids" or req.return_token_ids}
        if req.logprobs is None:
            c["logprobs"] = None
        choices.append(c)
    out["choices"] = choices
    return out


def usage_chunk(resp: dict[str, Any], req: CompletionRequest) -> dict[str, Any] | None:
    """The closing usage chunk (`choices: []`) when `stream_options.include_usage` asks for it."""
    if not (req.stream_options or {}).get("include_usage"):
        return None
    return {k: resp.get(k) for k in ("id", "object", "created")} | {"model": req.model, "choices": [],
                                                                   "usage": resp.get("usage")}  # fmt: skip


def sse(data: dict[str, Any]) -> str:
    """One SSE frame."""
    return f"data: {json.dumps(data)}\n\n"
