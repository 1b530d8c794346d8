"""The Anthropic messages face through the official `anthropic` SDK: plain, streaming, tool blocks,
errors in Anthropic's shape, and tito merging of multi-turn rollouts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import pytest

from harnessrl.adapter import merge_calls
from harnessrl.chat import render_chat
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from tests.support.gateway import GatewayHandle

TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]  # fmt: skip


def client(gw: GatewayHandle, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def test_messages_and_tool_blocks_are_translated_and_recorded(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    history = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me compute."},
            {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "2+3"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                     {"type": "text", "text": "And now?"}]},
    ]  # fmt: skip
    msg = client(gw, key).messages.create(
        model="claude-sonnet-4-5",
        max_tokens=8,
        system="Be brief.",
        messages=history,
        tools=TOOLS,  # type: ignore[arg-type]
    )
    assert msg.role == "assistant" and msg.model == "claude-sonnet-4-5"
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    (call,) = gw.store.calls(rid)
    assert call.face == "anthropic.messages" and call.chat is not None
    canonical = call.chat["messages"]
    assert [m["role"] for m in canonical] == ["system", "user", "assistant", "tool", "user"]
    assert canonical[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert canonical[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}
    tok = TitoTokenizer.from_dir(str(tiny_model_dir))
    assert call.prompt_ids == tok.encode(render_chat(canonical, tools=call.chat["tools"]))
    assert msg.usage.output_tokens == len(call.completion_ids)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == call.response["content"][0]["text"]  # type: ignore[index]


def test_streaming_follows_the_anthropic_event_sequence(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    with client(gw, key).messages.stream(
        model="claude-x",
        max_tokens=10,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,  # type: ignore[arg-type]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    (call,) = gw.store.calls(rid)
    assert final.model_dump(exclude_none=True)["content"] == call.response["content"]  # type: ignore[index]
    assert final.stop_reason == call.response["stop_reason"]  # type: ignore[index]


def test_errors_use_the_anthropic_shape(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    with pytest.raises(anthropic.BadRequestError) as e:
        client(gw, key).messages.create(model="m", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        client(gw, "sk-ant-nope").messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    r = httpx.post(f"{gw.url}/v1/messages", content=b"{oops", headers={"x-api-key": key})
    assert r.status_code == 400 and r.json()["type"] == "error"
    bad_block = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "image"}]}],
    }
    r = httpx.post(f"{gw.url}/v1/messages", json=bad_block, headers={"x-api-key": key})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    assert gw.store.calls(rid) == []


def test_anthropic_rollouts_merge_in_tito_mode(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway(mode="tito", tokenizer_path=str(tiny_model_dir))
    rid, key = gw.new_rollout()
    c = client(gw, key)
    messages: list[dict] = [{"role": "user", "content": "Hello!"}]  # type: ignore[type-arg]
    for i in range(3):
        msg = c.messages.create(model="m", max_tokens=8, system="Chat.", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
        messages.append({"role": "user", "content": f"more {i}"})
    result = merge_calls(gw.store.calls(rid))
    assert len(result.rows) == 1 and result.n_calls == 3


@pytest.mark.parametrize("mode", ["passthrough", "tito"])
def test_usage_splits_the_prompt_into_fresh_and_cache_read_tokens(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path, mode: str
) -> None:
    """Two calls sharing a long system prompt: the second's prefix comes from the engine's cache, which
    Anthropic's usage reports as `cache_read_input_tokens`, leaving the rest in `input_tokens`; the two
    add up to the prompt the engine took, streamed or not."""
    gw = make_gateway(mode=mode, tokenizer_path=str(tiny_model_dir))
    rid, key = gw.new_rollout()
    system = f"You add numbers. Session {mode} " + "one two three " * 40
    c = client(gw, key)
    first = c.messages.create(model="claude-x", max_tokens=4, system=system,
                              messages=[{"role": "user", "content": "2 + 3?"}])  # fmt: skip
    second = c.messages.create(model="claude-x", max_tokens=4, system=system,
                               messages=[{"role": "user", "content": "4 + 5?"}])  # fmt: skip
    with c.messages.stream(model="claude-x", max_tokens=4, system=system,
                           messages=[{"role": "user", "content": "6 + 7?"}]) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    calls = gw.store.calls(rid)
    assert first.usage.cache_creation_input_tokens == 0
    for msg, call in zip([first, second, streamed], calls, strict=True):
        u = msg.usage
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == len(call.prompt_ids)
        assert u.output_tokens == len(call.completion_ids)
    for later in (second, streamed):  # the system prompt (~125 tokens) is shared; the user turn is not
        assert 100 < (later.usage.cache_read_input_tokens or 0) < len(calls[1].prompt_ids)
