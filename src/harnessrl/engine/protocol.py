"""Wire shapes of the engine protocol (vLLM's names) and the pure functions that build responses."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harnessrl.chat import CHATML, ChatFormat
from harnessrl.engine.detok import TokenText
from harnessrl.engine.sequence import GenerationResult

MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    """Fields shared by both generation endpoints; unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's convention: -1 or 0 = no limit
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def stop_list(self) -> list[str]:
        """`stop` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class EngineCompletionRequest(_Request):
    """POST /v1/completions: the prompt is text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None


class EngineChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages (+ tools) rendered with the model's chat format."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's name: e.g. {"enable_thinking": false}


class TokenizeRequest(BaseModel):
    """POST /tokenize: either `prompt` text or chat `messages` (+ `tools`)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="allow")

    tokens: list[int]


class LoadWeightsRequest(BaseModel):
    """POST /admin/load_weights: a directory with model.safetensors, or a .safetensors file (`path`);
    or a shared-memory segment the trainer wrote the weights into (`shm`, modeling/weight_shm.py)."""

    path: str | None = None
    shm: str | None = None
    version: int
    # a served LoRA adapter's name (an engine started with --lora-adapters): `path` is its PEFT folder
    adapter: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def error_body(
    message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI usage block (with cached prompt tokens from the prefix cache)."""
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def completion_logprobs(result: GenerationResult, text: TokenText) -> dict[str, Any]:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [text.token_str(t) for t in result.token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top: list[dict[str, float]] = []
    for tok, lp, alts in zip(tokens, result.logprobs, result.top_logprobs, strict=True):
        entry = {tok: lp}
        for tid, alp in alts:
            entry.setdefault(text.token_str(tid), alp)
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": result.logprobs, "top_logprobs": top, "text_offset": offsets}


def completion_response(
    result: GenerationResult, model: str, text: TokenText, req: EngineCompletionRequest
) -> dict[str, Any]:
    """The `text_completion` body; token ids/logprobs as asked, `weight_version` always."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": result.text,
        "logprobs": completion_logprobs(result, text) if req.logprobs is not None else None,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
    }
    body = _envelope(f"cmpl-{uuid.uuid4().hex}", "text_completion", model, choice, result)
    if req.return_token_ids is not False:
        choice["token_ids"] = result.token_ids
        choice["prompt_token_ids"] = result.prompt_ids
        body["prompt_token_ids"] = result.prompt_ids
    return body


def _envelope(
    rid: str, obj: str, model: str, choice: dict[str, Any], result: GenerationResult
) -> dict[str, Any]:
    """The body around one choice: ids, usage and the weight version that generated it."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(result), "weight_version": result.weight_version,
            **({"adapter": result.adapter} if result.adapter is not None else {})}  # fmt: skip


def _lp_entry(text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": text.token_str(token_id), "logprob": logprob, "bytes": list(text.token_bytes(token_id))}


def chat_logprobs(result: GenerationResult, text: TokenText) -> dict[str, Any]:
    """Chat logprobs: one entry per generated token (the final EOS included)."""
    content = []
    for tid, lp, alts in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True):
        entry = _lp_entry(text, tid, lp)
        entry["top_logprobs"] = [_lp_entry(text, a, alp) for a, alp in alts]
        content.append(entry)
    return {"content": content}


def chat_response(
    result: GenerationResult,
    model: str,
    text: TokenText,
    req: EngineChatCompletionRequest,
    chat: ChatFormat = CHATML,
) -> dict[str, Any]:
    """The `chat.completion` body: parsed content, reasoning and tool calls in the model's own format,
    exact ids, logprobs, weight_version."""
    parsed = chat.parse(result.text, req.tools)
    finish: str = result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
        message["content"] = parsed.content if parsed.content.strip() else None
        finish = "tool_calls" if finish == "stop" else finish
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(result, text) if req.logprobs else None,
        "finish_reason": finish,
        "stop_reason": result.stop_reason,
    }
    body = _envelope(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", model, choice, result)
    if req.return_token_ids is not False:
        choice["token_ids"] = result.token_ids
        body["prompt_token_ids"] = result.prompt_ids
    return body
