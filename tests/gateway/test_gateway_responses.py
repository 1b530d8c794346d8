"""The Responses face through the openai SDK: plain, streaming, function calls, previous_response_id."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from harnessrl.adapter import merge_calls
from harnessrl.chat import render_chat
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from tests.support.gateway import GatewayHandle

TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]  # fmt: skip


def sdk(gw: GatewayHandle, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def test_response_with_function_call_items_is_translated(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    items = [
        {"role": "user", "content": "What is 2+3?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "calculator",
            "arguments": '{"expression": "2+3"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    resp = sdk(gw, key).responses.create(model="gpt-4.1", instructions="Be brief.", input=items, tools=TOOLS,  # type: ignore[arg-type]
                                         max_output_tokens=8)  # fmt: skip
    assert resp.id.startswith("resp_") and resp.model == "gpt-4.1"
    (call,) = gw.store.calls(rid)
    canonical = call.chat["messages"]  # type: ignore[index]
    assert [m["role"] for m in canonical] == ["system", "user", "assistant", "tool"]
    assert canonical[2]["tool_calls"][0]["function"]["arguments"] == '{"expression": "2+3"}'
    tok = TitoTokenizer.from_dir(str(tiny_model_dir))
    assert call.prompt_ids == tok.encode(render_chat(canonical, tools=call.chat["tools"]))  # type: ignore[index]
    assert resp.output_text == (call.chat["answer"]["content"] or "")  # type: ignore[index]
    assert resp.usage is not None and resp.usage.output_tokens == len(call.completion_ids)


def test_streaming_and_previous_response_id(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway(mode="tito", tokenizer_path=str(tiny_model_dir))
    rid, key = gw.new_rollout()
    client = sdk(gw, key)
    first = client.responses.create(
        model="m", instructions="Chat.", input="Hello!", tools=TOOLS, max_output_tokens=8
    )  # type: ignore[arg-type]
    with client.responses.stream(model="m", instructions="Chat.", input="And again?", tools=TOOLS,  # type: ignore[arg-type]
                                 previous_response_id=first.id, max_output_tokens=8) as stream:  # fmt: skip
        events = list(stream)
    kinds = [e.type for e in events]
    final = events[-1].response  # type: ignore[union-attr]  # completed, or incomplete at max_output_tokens
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    first_call, second_call = gw.store.calls(rid)
    assert final.id == second_call.response["id"]  # type: ignore[index]
    assert final.output_text == (second_call.chat["answer"]["content"] or "")  # type: ignore[index]
    # the second call continues the first: one row
    assert len(merge_calls([first_call, second_call]).rows) == 1
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")


def test_hosted_tools_are_dropped_and_recorded_and_empty_input_is_a_clear_400(
    make_gateway: Callable[..., GatewayHandle],
) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    client = sdk(gw, key)
    client.responses.create(model="m", input="x", max_output_tokens=2, tools=[{"type": "web_search"}])  # type: ignore[list-item]
    (call,) = gw.store.calls(rid)
    assert call.chat is not None and call.chat["tools"] is None
    assert [t["type"] for t in call.chat["dropped_tools"]] == ["web_search"]
    # an input holding only items of hosted tools leaves nothing to answer
    with pytest.raises(openai.BadRequestError, match="at least one input item"):
        client.responses.create(model="m", input=[{"type": "image_generation_call", "id": "x"}])  # type: ignore[list-item]
    assert len(gw.store.calls(rid)) == 1
