"""Reaching the engine for a canonical chat call: passthrough (the engine renders the template) or
token-in-token-out (the gateway sends token IDs). Both return a `Generation` with the exact tokens."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from harnessrl.chat import CHATML, ChatFormat
from harnessrl.gateway.canonical import ChatCall, Generation, Sampling, TokenRecord
from harnessrl.gateway.engine_client.answers import (
    Accumulator,
    BadUpstreamResponse,
    cached_tokens,
    check_prompt,
    finish_reason,
    read_chat,
    read_completion,
    reading,
    stop_string,
)
from harnessrl.gateway.engine_client.upstream import StickyUpstream
from harnessrl.gateway.tito import TitoPrompt, build_prompt
from harnessrl.schema import Call, CallStatus

__all__ = ["BadUpstreamResponse"]  # re-exported: the gateway's handlers catch it from here


@dataclass(frozen=True)
class TitoTokenizer:
    """What tito needs of the served model: its tokenizer, end-of-turn token and chat format (the
    folder's own template, tool-call format and stop ids)."""

    tokenizer: Tokenizer
    eos_id: int
    chat: ChatFormat = CHATML

    @classmethod
    def from_dir(
        cls,
        path: str,
        eos_token: str | None = None,
        tool_parser: str = "auto",
        template_kwargs: dict[str, Any] | None = None,
    ) -> TitoTokenizer:
        """Load `tokenizer.json` and the chat format from a model directory (`eos_token`: the
        end-of-turn token; default the chat format's own, `<|im_end|>` for ChatML)."""
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        chat = ChatFormat.from_folder(path, tool_parser, template_kwargs)
        name = eos_token or chat.rules.stop_texts[0]
        eos = tok.token_to_id(name)
        if eos is None:
            raise ValueError(f"tokenizer in {path} has no token {name!r}")
        return cls(tok, eos, chat)

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end the model's turn (the family's markers and generation_config's eos)."""
        return sorted(self.chat.stop_ids | {self.eos_id})

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


def tito_prompt(call: ChatCall, tokenizer: TitoTokenizer, history: Sequence[Call]) -> TitoPrompt:
    """The call's prompt tokens, built here with the model's chat format (an earlier call's exact tokens
    reused where the messages extend it)."""
    return build_prompt(call.messages, call.tools, history, tokenizer.encode, tokenizer.eos_id,
                        chat=tokenizer.chat, template_kwargs=call.template_kwargs)  # fmt: skip


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
    if call.template_kwargs:
        body["chat_template_kwargs"] = call.template_kwargs
    resp = await upstream.post("/v1/chat/completions", body)
    a = read_chat(resp)
    choice = resp["choices"][0]
    return Generation(a.text, a.tool_calls, finish_reason(a.tool_calls, a.record), a.record, a.token_texts,
                      stop_string(choice), cached_tokens(resp), a.reasoning)  # fmt: skip


async def tito(
    upstream: StickyUpstream,
    served: str,
    call: ChatCall,
    sampling: Sampling,
    tokenizer: TitoTokenizer,
    history: Sequence[Call],
) -> Generation:
    """Build the prompt's token IDs here (reusing earlier calls' tokens) and send them as a prompt."""
    prompt = tito_prompt(call, tokenizer, history)
    body: dict[str, Any] = {
        "model": served,
        "prompt": prompt.prompt_ids,
        "stop_token_ids": tokenizer.stop_ids,
        "return_token_ids": True,
        "logprobs": call.top_logprobs or 1,
        **_sampling_fields(sampling),
    }
    resp = await upstream.post("/v1/completions", body)
    a = read_completion(resp, need_text=True)
    check_prompt(a.record, prompt.prompt_ids)
    parsed = tokenizer.chat.for_request(call.template_kwargs).parse(a.text, call.tools)
    choice = resp["choices"][0]
    return Generation(parsed.content, parsed.tool_calls, finish_reason(parsed.tool_calls, a.record), a.record,
                      a.token_texts, stop_string(choice), cached_tokens(resp), parsed.reasoning_content)  # fmt: skip


def raw_completion_body(
    served: str, prompt: str | list[int], sampling: Sampling, logprobs: int
) -> dict[str, Any]:
    """The engine request of a `/v1/completions` call (token IDs and logprobs always asked for)."""
    return {"model": served, "prompt": prompt, "return_token_ids": True, "logprobs": max(logprobs, 1),
            **_sampling_fields(sampling)}  # fmt: skip


async def raw_completion(upstream: StickyUpstream, served: str, prompt: str | list[int], sampling: Sampling,
                         logprobs: int) -> tuple[dict[str, Any], TokenRecord]:  # fmt: skip
    """`/v1/completions` as is: the engine's answer and its token record."""
    resp = await upstream.post("/v1/completions", raw_completion_body(served, prompt, sampling, logprobs))
    return resp, read_completion(resp).record


# streaming --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContentDelta:
    """Content the harness can be sent now (never part of a tool call, never taken back)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Thinking text of a reasoning model the harness can be sent now (before the answer's content)."""

    text: str


Items = AsyncGenerator[ContentDelta | ReasoningDelta | Generation, None]


class EngineStream:
    """A streamed generation: `ContentDelta`s as they come, then the `Generation`. An engine event
    that lacks what the gateway must record raises `BadUpstreamResponse`. `partial()` is what the
    engine produced so far, for a call cut short (the client went away)."""

    def __init__(self, acc: Accumulator, items: Items) -> None:
        self.acc = acc
        self.text = ""  # the content handed out so far
        self._items = items

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> ContentDelta | ReasoningDelta | Generation:
        item = await self._items.__anext__()
        if isinstance(item, ContentDelta):
            self.text += item.text
        return item

    async def aclose(self) -> None:
        """Close the engine's stream (the engine then stops generating)."""
        await self._items.aclose()

    def partial(self) -> TokenRecord:
        """The tokens generated so far (those with their logprob), marked `finish_reason="cancelled"`."""
        return self.acc.partial()


Streamed = EngineStream


def cut_short(call: Call, record: TokenRecord, latency_s: float, text: str, chat: ChatCall | None) -> Call:
    """The record of a streamed call whose client went away: the tokens generated until then, and for
    chat faces the conversation with the content sent so far as its answer; status `cancelled`."""
    n = len(record.completion_ids)
    answer = {"role": "assistant", "content": text}
    return call.model_copy(
        update={
            "latency_s": latency_s,
            "status": CallStatus.CANCELLED,
            "finish_reason": "cancelled",
            "error": f"cancelled: the client disconnected after {n} completion tokens",
            "prompt_ids": record.prompt_ids,
            "completion_ids": record.completion_ids,
            "completion_logprobs": record.completion_logprobs,
            "weight_version": record.weight_version,
            "chat": None
            if chat is None
            else {**(call.chat or {}), "messages": chat.messages, "tools": chat.tools, "answer": answer},
        }
    )


# Streamed engine requests ask for the closing usage chunk (vLLM sends usage only then; the builtin
# engine always does): it carries the prompt tokens taken from the prefix cache.
STREAM_USAGE = {"include_usage": True}


async def passthrough_stream(
    upstream: StickyUpstream, served: str, call: ChatCall, sampling: Sampling
) -> Streamed:
    """Stream from the engine's chat endpoint: content deltas as they come, tool calls at the end."""
    body: dict[str, Any] = {"model": served, "messages": call.messages, "return_token_ids": True, "logprobs": True,
                            "stream_options": STREAM_USAGE, **_sampling_fields(sampling)}  # fmt: skip
    if call.tools:
        body["tools"] = call.tools
    if call.template_kwargs:
        body["chat_template_kwargs"] = call.template_kwargs
    events = await upstream.open_stream("/v1/chat/completions", body)
    acc = Accumulator()
    return EngineStream(acc, _passthrough_events(events, acc))


async def _passthrough_events(events: AsyncIterator[dict[str, Any]], acc: Accumulator) -> Items:
    content, reasoning, calls = "", "", {}  # type: ignore[var-annotated]
    async for event in events:
        with reading("the engine sent a malformed stream event"):
            choice = acc.take(event)
            entries = (choice.get("logprobs") or {}).get("content") or []
            acc.logprobs += [float(e["logprob"]) for e in entries]  # all or none of the event's
            acc.texts += [str(e.get("token", "")) for e in entries]
            delta = choice.get("delta") or {}
            piece = str(delta.get("content") or "")
            thought = str(delta.get("reasoning_content") or delta.get("reasoning") or "")
            _take_tool_calls(calls, delta.get("tool_calls") or [])
        if thought:
            reasoning += thought
            yield ReasoningDelta(thought)
        if piece:
            content += piece
            yield ContentDelta(piece)
    record = acc.record()
    tool_calls = [calls[i] for i in sorted(calls)]
    yield Generation(content, tool_calls, finish_reason(tool_calls, record), record, acc.texts, acc.stop,
                     acc.cached, reasoning or None)  # fmt: skip


def _take_tool_calls(calls: dict[int, dict[str, Any]], deltas: list[Any]) -> None:
    """Add streamed tool-call pieces (OpenAI's `delta.tool_calls`) to the calls being assembled."""
    for tc in deltas:
        slot = calls.setdefault(int(tc.get("index", len(calls))), {"id": "", "type": "function",
                                                                   "function": {"name": "", "arguments": ""}})  # fmt: skip
        slot["id"] = tc.get("id") or slot["id"]
        fn = tc.get("function") or {}
        slot["function"]["name"] += str(fn.get("name") or "")
        slot["function"]["arguments"] += str(fn.get("arguments") or "")


async def tito_stream(upstream: StickyUpstream, served: str, call: ChatCall, sampling: Sampling,
                      tokenizer: TitoTokenizer, history: Sequence[Call]) -> Streamed:  # fmt: skip
    """Stream a tito call from `/v1/completions`; the gateway parses tool calls out of the text."""
    prompt = tito_prompt(call, tokenizer, history)
    body: dict[str, Any] = {"model": served, "prompt": prompt.prompt_ids, "stop_token_ids": tokenizer.stop_ids,
                            "return_token_ids": True, "logprobs": call.top_logprobs or 1, "stream_options": STREAM_USAGE,
                            **_sampling_fields(sampling)}  # fmt: skip
    events = await upstream.open_stream("/v1/completions", body)
    acc = Accumulator()
    chat = tokenizer.chat.for_request(call.template_kwargs)  # thinking opened by this request's prompt?
    return EngineStream(acc, _tito_events(events, prompt.prompt_ids, acc, chat, call.tools))


async def _tito_events(
    events: AsyncIterator[dict[str, Any]],
    sent: list[int],
    acc: Accumulator,
    chat: ChatFormat = CHATML,
    tools: list[dict[str, Any]] | None = None,
) -> Items:
    parser, text = chat.streaming_parser(tools), ""
    while True:
        try:
            with reading("the engine sent a malformed stream event"):  # an adapter's translation (SGLang)
                event = await anext(events)
        except StopAsyncIteration:
            break
        _, piece = acc.take_completion(event)
        text += piece
        thought, out = parser.feed_parts(piece)
        if thought:
            yield ReasoningDelta(thought)
        if out:
            yield ContentDelta(out)
    record = acc.record()
    check_prompt(record, sent)
    parsed, rest = parser.finish(text)
    if thought := parser.reasoning_rest(parsed):
        yield ReasoningDelta(thought)
    if rest:
        yield ContentDelta(rest)
    finish = finish_reason(parsed.tool_calls, record)
    yield Generation(parsed.content, parsed.tool_calls, finish, record, acc.texts, acc.stop, acc.cached,
                     parsed.reasoning_content)  # fmt: skip


class RawCompletionStream:
    """Accumulates a streamed `/v1/completions` answer: its token record and the answer as one body."""

    def __init__(self) -> None:
        self.acc = Accumulator()
        self.text = ""
        self.usage: dict[str, Any] | None = None
        self.head: dict[str, Any] = {}

    def take(self, event: dict[str, Any]) -> dict[str, Any]:
        """Absorb one engine event; return its first choice (`BadUpstreamResponse` when malformed)."""
        if not self.head:
            self.head = {k: event.get(k) for k in ("id", "object", "created", "model")}
        choice, piece = self.acc.take_completion(event)
        self.text += piece
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        return choice

    def partial(self) -> TokenRecord:
        """The tokens generated so far, for a call cut short."""
        return self.acc.partial()

    def finish(self) -> tuple[dict[str, Any], TokenRecord]:
        """The answer as a non-streamed body would have carried it, and the token record."""
        record = self.acc.record()
        choice = {"index": 0, "text": self.text, "finish_reason": record.finish_reason,
                  "stop_reason": self.acc.stop, "token_ids": record.completion_ids,
                  "logprobs": {"tokens": self.acc.texts, "token_logprobs": record.completion_logprobs}}  # fmt: skip
        n_prompt, n_out = len(record.prompt_ids), len(record.completion_ids)
        usage = self.usage or {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        }
        resp = {**self.head, "object": "text_completion", "choices": [choice], "usage": usage,
                "prompt_token_ids": record.prompt_ids, "weight_version": record.weight_version}  # fmt: skip
        return resp, record
