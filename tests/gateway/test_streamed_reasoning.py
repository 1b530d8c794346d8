"""A reasoning model's thinking streams as it is generated, in each face's own events, and the real SDKs'
stream readers assemble the same answer as the face's non-streamed body: chat `reasoning_content`
chunks, an Anthropic `thinking` block (thinking_delta events) before the text block, a Responses
`reasoning` item (reasoning_text.delta events) at output index 0 before the message.

The items come from the gateway's tito stream parser fed a completion that Qwen3's real tokenizer
splits into tokens (one engine event per token); the frames are served over loopback HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from harnessrl.gateway.canonical import Generation
from harnessrl.gateway.engine_client.answers import Accumulator
from harnessrl.gateway.engine_client.inference import (
    ContentDelta,
    ReasoningDelta,
    TitoTokenizer,
    _tito_events,
)
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces import anthropic as anthropic_face
from harnessrl.gateway.faces import openai_chat as chat_face
from harnessrl.gateway.faces import responses as responses_face
from tests.support.conversations import tokenizer_dir
from tests.support.gateway import ThreadServer

WRITTEN = "<think>\nThe user adds two and three.\n</think>\n\nIt is 5.<|im_end|>"
PROMPT = [9707, 11]


def engine_items() -> list[ContentDelta | ReasoningDelta | Generation]:
    """What the gateway's tito stream makes of Qwen3 writing WRITTEN, one token per engine event."""
    tok = TitoTokenizer.from_dir(str(tokenizer_dir("qwen3")))
    ids = tok.encode(WRITTEN)

    async def events() -> AsyncIterator[dict[str, Any]]:
        for i, t in enumerate(ids):
            piece = tok.tokenizer.decode([t], skip_special_tokens=False)
            text = "" if t in tok.stop_ids else piece
            yield {"prompt_token_ids": PROMPT, "choices": [{"text": text, "token_ids": [t],
                   "logprobs": {"token_logprobs": [-0.5], "tokens": [piece]},
                   "finish_reason": "stop" if i == len(ids) - 1 else None}]}  # fmt: skip

    async def collect() -> list[Any]:
        return [item async for item in _tito_events(events(), PROMPT, Accumulator(), tok.chat)]

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def items() -> list[ContentDelta | ReasoningDelta | Generation]:
    got = engine_items()
    kinds = [type(i).__name__ for i in got]
    assert kinds.index("ReasoningDelta") < kinds.index("ContentDelta") < kinds.index("Generation")
    assert kinds.count("ReasoningDelta") > 1  # streamed in pieces, not once at the end
    return got


def frames_of(streamer: Any, face_body: dict[str, Any], items: list[Any]) -> list[str]:
    """The frames `_relay` writes for these items."""
    frames = list(streamer.start())
    for item in items:
        if isinstance(item, ContentDelta):
            frames += streamer.delta(item.text)
        elif isinstance(item, ReasoningDelta):
            frames += streamer.reasoning(item.text)
        else:
            frames += streamer.end(item, face_body)
    return frames


@pytest.fixture(scope="module")
def server(items: list[Any]) -> Iterator[str]:
    gen = items[-1]
    ids = ResponseIds("s1", 0)

    async def chat(request: Request) -> StreamingResponse:
        req = chat_face.parse_request(await request.json())
        body = chat_face.chat_response(gen, req, "chatcmpl-s1", 0)
        return StreamingResponse(iter(frames_of(chat_face.ChatStreamer(req, ids), body, items)))

    async def messages(request: Request) -> StreamingResponse:
        req = anthropic_face.parse_request(await request.json())
        body = anthropic_face.message_response(gen, req, ids)
        return StreamingResponse(iter(frames_of(anthropic_face.MessageStreamer(req, ids), body, items)))

    async def responses(request: Request) -> StreamingResponse:
        req = responses_face.parse_request(await request.json())
        body = responses_face.response_object(gen, req, ids)
        return StreamingResponse(iter(frames_of(responses_face.ResponseStreamer(req, ids), body, items)))

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/messages", messages, methods=["POST"]),
                            Route("/v1/responses", responses, methods=["POST"])])  # fmt: skip
    with ThreadServer(app) as srv:
        yield srv.url


def test_the_parser_splits_thinking_from_content(items: list[Any]) -> None:
    gen = items[-1]
    assert gen.reasoning == "The user adds two and three." and gen.content == "It is 5."
    assert "".join(i.text for i in items if isinstance(i, ReasoningDelta)) == gen.reasoning
    assert "".join(i.text for i in items if isinstance(i, ContentDelta)) == gen.content


def test_chat_stream_carries_reasoning_content_chunks(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+3?"}], stream=True
    )
    reasoning, content = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == ("The user adds two and three.", "It is 5.")


def test_anthropic_stream_assembles_the_thinking_block(server: str) -> None:
    client = anthropic.Anthropic(base_url=server, api_key="k", max_retries=0)
    with client.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "2+3?"}]
    ) as s:
        thinking = [e.thinking for e in s if e.type == "thinking"]
        final = s.get_final_message()
    assert len(thinking) > 1 and "".join(thinking) == "The user adds two and three."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user adds two and three."  # type: ignore[union-attr]
    assert final.content[1].text == "It is 5." and final.stop_reason == "end_turn"  # type: ignore[union-attr]


def test_responses_stream_puts_the_reasoning_item_first(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="k", max_retries=0)
    events = list(client.responses.create(model="m", input="2+3?", stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "The user adds two and three."
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.output_index for e in text} == {1} and "".join(e.delta for e in text) == "It is 5."
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "It is 5."
