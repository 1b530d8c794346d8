"""Reaching the engine for a canonical chat call: passthrough (the engine renders the template) or
token-in-token-out (the gateway sends token IDs). Both return a `Generation` with the exact tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from harnessrl.chat import parse_completion
from harnessrl.gateway.canonical import ChatCall, Generation, Sampling, TokenRecord
from harnessrl.gateway.tito import build_prompt
from harnessrl.gateway.upstream import StickyUpstream
from harnessrl.schema import Call


class BadUpstreamResponse(ValueError):
    """The engine's answer lacks the token IDs or logprobs the gateway must record."""


@dataclass(frozen=True)
class TitoTokenizer:
    """What tito needs of the served model: its tokenizer and end-of-turn token."""

    tokenizer: Tokenizer
    eos_id: int

    @classmethod
    def from_dir(cls, path: str, eos_token: str = "<|im_end|>") -> TitoTokenizer:
        """Load `tokenizer.json` from a model directory."""
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"tokenizer in {path} has no token {eos_token!r}")
        return cls(tok, eos)

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text` (special tokens such as <|im_start|> recognised, nothing added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _sampling_fields(s: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": s.max_tokens, "temperature": s.temperature}
    for key in ("top_p", "seed", "stop"):
        value = getattr(s, key)
        if value is not None:
            body[key] = value
    return body


def _version(resp: dict[str, Any]) -> int | None:
    v = resp.get("weight_version")
    return int(v) if isinstance(v, int) else None


async def passthrough(
    upstream: StickyUpstream, served: str, call: ChatCall, sampling: Sampling
) -> Generation:
    """Send the messages to the engine's chat endpoint with `return_token_ids` and logprobs."""
    body: dict[str, Any] = {
        "model": served,
        "messages": call.messages,
        "return_token_ids": True,
        "logprobs": True,
        **_sampling_fields(sampling),
    }
    if call.tools:
        body["tools"] = call.tools
    if call.top_logprobs:
        body["top_logprobs"] = call.top_logprobs
    resp = await upstream.post("/v1/chat/completions", body)
    try:
        choice = resp["choices"][0]
        message = choice["message"]
        content = (choice.get("logprobs") or {}).get("content") or []
        record = TokenRecord(
            prompt_ids=[int(t) for t in resp["prompt_token_ids"]],
            completion_ids=[int(t) for t in choice["token_ids"]],
            completion_logprobs=[float(c["logprob"]) for c in content],
            finish_reason=choice.get("finish_reason"),
            weight_version=_version(resp),
        )
        texts = [str(c.get("token", "")) for c in content]
        tool_calls = list(message.get("tool_calls") or [])
        text = message.get("content") or ""
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise BadUpstreamResponse(f"engine answer lacks token ids or logprobs: {e!r}") from e
    _check_lengths(record)
    finish = "tool_calls" if tool_calls else (record.finish_reason or "stop")
    return Generation(text, tool_calls, finish, record, texts, _stop_string(choice))


async def tito(
    upstream: StickyUpstream,
    served: str,
    call: ChatCall,
    sampling: Sampling,
    tokenizer: TitoTokenizer,
    history: Sequence[Call],
) -> Generation:
    """Build the prompt's token IDs here (reusing earlier calls' tokens) and send them as a prompt."""
    prompt = build_prompt(call.messages, call.tools, history, tokenizer.encode, tokenizer.eos_id)
    body: dict[str, Any] = {
        "model": served,
        "prompt": prompt.prompt_ids,
        "stop_token_ids": [tokenizer.eos_id],
        "return_token_ids": True,
        "logprobs": call.top_logprobs or 1,
        **_sampling_fields(sampling),
    }
    resp = await upstream.post("/v1/completions", body)
    try:
        choice = resp["choices"][0]
        lp = choice.get("logprobs") or {}
        record = TokenRecord(
            prompt_ids=[int(t) for t in resp["prompt_token_ids"]],
            completion_ids=[int(t) for t in choice["token_ids"]],
            completion_logprobs=[float(x) for x in lp.get("token_logprobs") or []],
            finish_reason=choice.get("finish_reason"),
            weight_version=_version(resp),
        )
        text = str(choice["text"])
        texts = [str(t) for t in lp.get("tokens") or []]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise BadUpstreamResponse(f"engine answer lacks token ids, text or logprobs: {e!r}") from e
    _check_lengths(record)
    if record.prompt_ids != prompt.prompt_ids:
        raise BadUpstreamResponse("the engine reports prompt token ids other than those the gateway sent")
    parsed = parse_completion(text)
    finish = "tool_calls" if parsed.tool_calls else (record.finish_reason or "stop")
    return Generation(parsed.content, parsed.tool_calls, finish, record, texts, _stop_string(choice))


async def raw_completion(upstream: StickyUpstream, served: str, prompt: str | list[int], sampling: Sampling,
                         logprobs: int) -> tuple[dict[str, Any], TokenRecord]:  # fmt: skip
    """`/v1/completions` as is: the engine's answer and its token record."""
    body = {"model": served, "prompt": prompt, "return_token_ids": True, "logprobs": max(logprobs, 1),
            **_sampling_fields(sampling)}  # fmt: skip
    resp = await upstream.post("/v1/completions", body)
    try:
        choice = resp["choices"][0]
        record = TokenRecord(
            prompt_ids=[int(t) for t in resp["prompt_token_ids"]],
            completion_ids=[int(t) for t in choice["token_ids"]],
            completion_logprobs=[
                float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []
            ],
            finish_reason=choice.get("finish_reason"),
            weight_version=_version(resp),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise BadUpstreamResponse(f"engine answer lacks token ids or logprobs: {e!r}") from e
    _check_lengths(record)
    return resp, record


def _stop_string(choice: dict[str, Any]) -> str | None:
    """The stop string that ended the completion, if any (vLLM's `stop_reason` holds it)."""
    reason = choice.get("stop_reason")
    return reason if isinstance(reason, str) else None


def _check_lengths(record: TokenRecord) -> None:
    if len(record.completion_logprobs) != len(record.completion_ids):
        raise BadUpstreamResponse(
            f"engine sent {len(record.completion_ids)} completion tokens but "
            f"{len(record.completion_logprobs)} logprobs"
        )
