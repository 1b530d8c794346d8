"""A reasoning model's thinking reaches the harness in each face's own shape, read back by the real SDKs:
chat `reasoning_content`, an Anthropic `thinking` block, a Responses `reasoning` item; and the engine's
chat answer (`reasoning_content`) is read by the gateway's passthrough."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai.types.chat as oai_chat
import openai.types.responses as oai_responses

from harnessrl.gateway.canonical import Generation, TokenRecord
from harnessrl.gateway.engine_client.answers import read_chat
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces import anthropic as anthropic_face
from harnessrl.gateway.faces import openai_chat as chat_face
from harnessrl.gateway.faces import responses as responses_face

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}


def _gen(reasoning: str | None, calls: list[dict[str, Any]] | None = None) -> Generation:
    record = TokenRecord([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "stop", 0)
    return Generation(
        "It is 5.", list(calls or []), "tool_calls" if calls else "stop", record, reasoning=reasoning
    )


def test_openai_chat_reasoning_content() -> None:
    req = chat_face.parse_request({"model": "m", "messages": [{"role": "user", "content": "2+3?"}]})
    body = chat_face.chat_response(_gen("Add them."), req, "chatcmpl-1", 0)
    message = oai_chat.ChatCompletion.model_validate(body).choices[0].message
    assert (
        message.content == "It is 5." and (message.model_extra or {}).get("reasoning_content") == "Add them."
    )
    plain = chat_face.chat_response(_gen(None), req, "chatcmpl-2", 0)
    assert "reasoning_content" not in plain["choices"][0]["message"]
    streamer = chat_face.ChatStreamer(req, ResponseIds("s", 0))
    frames = streamer.end(_gen("Add them.", [CALL]), body)
    first = oai_chat.ChatCompletionChunk.model_validate(json.loads(frames[0].removeprefix("data: ")))
    assert (first.choices[0].delta.model_extra or {}).get("reasoning_content") == "Add them."


def test_anthropic_thinking_block() -> None:
    req = anthropic_face.parse_request(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "2+3?"}]}
    )
    body = anthropic_face.message_response(_gen("Add them.", [CALL]), req, ResponseIds("a", 0))
    message = anthropic.types.Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Add them."  # type: ignore[union-attr]
    # a harness echoes the thinking block back: it is skipped on the way in
    echoed = {"role": "assistant", "content": body["content"]}
    nxt = anthropic_face.parse_request({"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": "2+3?"}, echoed,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "5"}]}]})  # fmt: skip
    assistant = anthropic_face.to_chat_call(nxt).messages[1]
    assert assistant["content"] == "It is 5." and assistant["tool_calls"][0]["function"]["name"] == "add"


def test_responses_reasoning_item() -> None:
    req = responses_face.parse_request({"model": "m", "input": "2+3?"})
    body = responses_face.response_object(_gen("Add them."), req, ResponseIds("r", 0))
    response = oai_responses.Response.model_validate(body)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Add them."  # type: ignore[union-attr,index]
    assert response.output_text == "It is 5."
    frames = responses_face.ResponseStreamer(req, ResponseIds("r", 0)).end(_gen("Add them."), body)
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    # reasoning not streamed before the end is sent then, as its own item at index 0, before the message's
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.done") == 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")


def test_passthrough_reads_the_engines_reasoning() -> None:
    resp = {"prompt_token_ids": [1], "choices": [{"message": {"role": "assistant", "content": "5",
            "reasoning_content": "Add."}, "token_ids": [2], "logprobs": {"content": [{"token": "5", "logprob": -0.1}]},
            "finish_reason": "stop"}]}  # fmt: skip
    assert read_chat(resp).reasoning == "Add."


def test_passthrough_stream_collects_the_engines_reasoning_deltas() -> None:
    import asyncio

    from harnessrl.gateway.engine_client.answers import Accumulator
    from harnessrl.gateway.engine_client.inference import ContentDelta, _passthrough_events

    def event(delta: dict[str, Any], tok: int, finish: str | None = None) -> dict[str, Any]:
        lp = {"content": [{"token": "t", "logprob": -0.5}]}
        return {"prompt_token_ids": [1], "choices": [{"delta": delta, "token_ids": [tok], "logprobs": lp,
                                                      "finish_reason": finish}]}  # fmt: skip

    async def events() -> Any:
        for e in (event({"reasoning_content": "Add "}, 2), event({"reasoning_content": "them."}, 3),
                  event({"content": "5"}, 4, "stop")):  # fmt: skip
            yield e

    async def collect() -> list[Any]:
        return [item async for item in _passthrough_events(events(), Accumulator())]

    items = asyncio.run(collect())
    assert [i.text for i in items if isinstance(i, ContentDelta)] == ["5"]
    assert items[-1].reasoning == "Add them." and items[-1].content == "5"
