"""Streaming generation (`stream: true`): server-sent events as tokens are sampled, in the shape vLLM
uses with `return_token_ids` — every chunk carries the new `token_ids` (and logprobs), the first one
the `prompt_token_ids`, the last one the finish reason, usage and `weight_version`.

Text is released as soon as it is final: never a tail that may still become a stop string, never an
incomplete UTF-8 character; the last chunk sends whatever the finished text still holds. In chat
streams, content (and a reasoning model's `reasoning_content`) streams through the model's chat format
(`engine.chat.streaming_parser()`), so a tool call never leaks out as text: its `tool_calls` delta
arrives with the final chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from harnessrl.chat.format import ChatFormat
from harnessrl.engine.detok import TokenText
from harnessrl.engine.sampling import SamplingParams
from harnessrl.engine.sequence import GenerationResult


@dataclass
class TextReleaser:
    """Turns a growing token list into text deltas that will never need to be taken back."""

    text: TokenText
    params: SamplingParams
    eos_ids: frozenset[int]
    ids: list[int] = field(default_factory=list)
    released: str = ""

    def add(self, token: int) -> str:
        """Add a sampled token; return the text that is final now."""
        self.ids.append(token)
        if token in self.eos_ids or token in self.params.stop_token_ids:
            return ""
        full = self.text.decode(self.ids, self.params.skip_special_tokens).rstrip("\ufffd")
        safe = len(full)
        for stop in self.params.stop:
            at = full.find(stop, max(0, len(self.released) - len(stop) + 1))
            if at >= 0:  # the sequence ends here; the text stops before the stop string
                safe = min(safe, at)
            for k in range(min(len(stop) - 1, len(full)), 0, -1):  # may still become a stop string
                if full.endswith(stop[:k]):
                    safe = min(safe, len(full) - k)
                    break
        if safe <= len(self.released) or not full[:safe].startswith(self.released):
            return ""
        delta, self.released = full[len(self.released) : safe], full[:safe]
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the finished text."""
        rest = final_text[len(self.released) :] if final_text.startswith(self.released) else ""
        self.released = final_text
        return rest


async def token_stream(
    engine: Any, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[tuple[int, float, list[tuple[int, float]]] | GenerationResult]:
    """Each sampled token (id, logprob, top alternatives) as it comes, then the `GenerationResult`."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def on_token(tok: int, lp: float, top: list[tuple[int, float]]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (tok, lp, top))

    def on_done(result: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, result)
        except RuntimeError:
            pass

    seq = engine.submit(prompt_ids, params, on_done, on_token)
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, GenerationResult):
                return
    finally:
        seq.cancelled = True  # no-op when finished; aborts the sequence when the client went away


def _frame(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(result: GenerationResult) -> dict[str, Any]:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}  # fmt: skip


async def completion_events(engine: Any, prompt_ids: list[int], params: SamplingParams, model: str,
                            want_logprobs: bool) -> AsyncIterator[str]:  # fmt: skip
    """SSE frames of a streamed `/v1/completions` answer."""
    base = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    releaser = TextReleaser(engine.text, params, frozenset(engine.eos_ids))
    first = True
    async for item in token_stream(engine, prompt_ids, params):
        if isinstance(item, GenerationResult):
            choice = {"index": 0, "text": releaser.finish(item.text), "logprobs": None, "token_ids": [],
                      "finish_reason": item.finish_reason, "stop_reason": item.stop_reason}  # fmt: skip
            yield _frame(
                {**base, "choices": [choice], "usage": _usage(item), "weight_version": item.weight_version}
            )
            break
        tok, lp, _ = item
        lps = {"tokens": [engine.text.token_str(tok)], "token_logprobs": [lp]} if want_logprobs else None
        chunk: dict[str, Any] = {**base, "choices": [{"index": 0, "text": releaser.add(tok), "logprobs": lps,
                                                      "token_ids": [tok], "finish_reason": None}]}  # fmt: skip
        if first:
            chunk["prompt_token_ids"], first = prompt_ids, False
        yield _frame(chunk)
    yield "data: [DONE]\n\n"


async def chat_events(engine: Any, prompt_ids: list[int], params: SamplingParams, model: str,
                      want_logprobs: bool, tools: list[dict[str, Any]] | None = None,
                      chat: ChatFormat | None = None) -> AsyncIterator[str]:  # fmt: skip
    """SSE frames of a streamed `/v1/chat/completions` answer (content streams, tool calls at the end,
    their arguments typed by the request's `tools` where the format writes them as text, as unstreamed;
    `chat`: the format for this request's template kwargs, the engine's by default)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}  # fmt: skip
    releaser = TextReleaser(engine.text, params, frozenset(engine.eos_ids))
    parser = (chat or engine.chat).streaming_parser(tools)

    def chunk(
        delta: dict[str, Any], tokens: list[int], lps: list[dict[str, Any]] | None, finish: str | None = None
    ) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": {"content": lps} if lps is not None else None,
                                     "token_ids": tokens, "finish_reason": finish}]}  # fmt: skip

    yield _frame({**chunk({"role": "assistant", "content": ""}, [], None), "prompt_token_ids": prompt_ids})
    async for item in token_stream(engine, prompt_ids, params):
        if isinstance(item, GenerationResult):
            reasoning = parser.feed_parts(releaser.finish(item.text))[0]
            parsed, rest = parser.finish(item.text)
            delta: dict[str, Any] = {"content": rest} if rest else {}
            if reasoning + parser.reasoning_rest(parsed):
                delta["reasoning_content"] = reasoning + parser.reasoning_rest(parsed)
            if parsed.tool_calls:
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(parsed.tool_calls)]
            finish = (
                "tool_calls" if parsed.tool_calls and item.finish_reason == "stop" else item.finish_reason
            )
            last = chunk(delta, [], None, finish)
            last["choices"][0]["stop_reason"] = item.stop_reason
            yield _frame({**last, "usage": _usage(item), "weight_version": item.weight_version})
            break
        tok, lp, _ = item
        reasoning, content = parser.feed_parts(releaser.add(tok))
        entry = [{"token": engine.text.token_str(tok), "logprob": lp, "bytes": list(engine.text.token_bytes(tok)),
                  "top_logprobs": []}] if want_logprobs else None  # fmt: skip
        parts = {"reasoning_content": reasoning, "content": content}
        yield _frame(chunk({k: v for k, v in parts.items() if v}, [tok], entry))
    yield "data: [DONE]\n\n"
