"""Qwen3.5's XML tool calls (one started before `</think>`) and Gemma 4's `<|tool_call>` calls reach the harness
in every face's own shape: the gateway's tito stream parser is fed the completion one token per engine
event (Qwen3's real tokenizer; Gemma 4's text pieces), and its `Generation` becomes an OpenAI chat
`tool_calls` message, an Anthropic `tool_use` block and a Responses `function_call` item, read back by
the SDKs' own types, with the arguments typed by the request's tool schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai.types.chat as oai_chat
import openai.types.responses as oai_responses
import pytest

from harnessrl.chat import ChatFormat
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
from tests.support.conversations import TOOLS
from tests.support.templates import template_folder

PROMPT = [9707, 11]
QWEN35 = ("I will add them.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
          "</parameter>\n</function>\n</tool_call><|im_end|>")  # fmt: skip
GEMMA4 = ["<|channel>", "thought", "\nI will", " add them.", "<channel|>", "<|tool_call>", "call:add{a:", "2,b", ":3}",
          "<tool_call|>", "<turn|>"]  # fmt: skip


def _events(pieces: list[str]) -> AsyncIterator[dict[str, Any]]:
    async def gen() -> AsyncIterator[dict[str, Any]]:
        for i, piece in enumerate(pieces):
            yield {"prompt_token_ids": PROMPT, "choices": [{"text": piece, "token_ids": [100 + i],
                   "logprobs": {"token_logprobs": [-0.5], "tokens": [piece]},
                   "finish_reason": "stop" if i == len(pieces) - 1 else None}]}  # fmt: skip

    return gen()


def _items(pieces: list[str], chat: ChatFormat) -> list[Any]:
    async def collect() -> list[Any]:
        return [item async for item in _tito_events(_events(pieces), PROMPT, Accumulator(), chat, TOOLS)]

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ChatFormat, list[str]]]:
    root = Path(tmp_path_factory.mktemp("formats"))
    qwen = TitoTokenizer.from_dir(
        str(template_folder("qwen3_5", root)), template_kwargs={"enable_thinking": True}
    )
    pieces = [qwen.tokenizer.decode([t], skip_special_tokens=False) for t in qwen.encode(QWEN35)]
    gemma = ChatFormat.from_folder(template_folder("gemma4", root))
    return {"qwen3_5": (qwen.chat, pieces), "gemma4": (gemma, GEMMA4)}


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_calls_reach_every_face(name: str, formats: dict[str, tuple[ChatFormat, list[str]]]) -> None:
    chat, pieces = formats[name]
    items = _items(pieces, chat)
    gen = items[-1]
    assert isinstance(gen, Generation) and gen.finish_reason == "tool_calls"
    assert (
        "".join(i.text for i in items if isinstance(i, ReasoningDelta)) == "I will add them." == gen.reasoning
    )
    assert "".join(i.text for i in items if isinstance(i, ContentDelta)).strip() == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in gen.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS}
    req = chat_face.parse_request(body)
    message = (
        oai_chat.ChatCompletion.model_validate(chat_face.chat_response(gen, req, "c1", 0)).choices[0].message
    )
    assert message.tool_calls and json.loads(message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}  # type: ignore[union-attr]
    areq = anthropic_face.parse_request({"model": "m", "max_tokens": 9, "messages": body["messages"],
                                         "tools": [{"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}]})  # fmt: skip
    amsg = anthropic.types.Message.model_validate(
        anthropic_face.message_response(gen, areq, ResponseIds("a", 0))
    )
    use = [b for b in amsg.content if b.type == "tool_use"]
    assert amsg.stop_reason == "tool_use" and use[0].name == "add" and use[0].input == {"a": 2, "b": 3}
    assert amsg.content[0].type == "thinking"
    rreq = responses_face.parse_request({"model": "m", "input": "2+3?", "tools": [{"type": "function", "name": "add",
                                         "parameters": TOOLS[0]["function"]["parameters"]}]})  # fmt: skip
    response = oai_responses.Response.model_validate(
        responses_face.response_object(gen, rreq, ResponseIds("r", 0))
    )
    calls = [o for o in response.output if o.type == "function_call"]
    assert calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 2, "b": 3}
