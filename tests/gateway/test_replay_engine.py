"""The replay engine of the real-program suite (bench/harnesses/replay_engine.py): a real engine process
whose completions are scripted, behind a real gateway (passthrough and tito), driven by the openai SDK
through a full tool loop. Checks the token IDs the gateway records against the real tokenizer."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.harnesses.replay_engine import (
    Script,
    ScriptStep,
    ToolStep,
    declared_tools,
    prompt_step,
    scripted_answer,
)
from openai import OpenAI

from harnessrl.adapter.merge import merge_calls
from harnessrl.chat import render_chat, render_tool_call
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.modeling.loading import smollm2_tokenizer_dir
from harnessrl.services import Service, free_port, start_service
from harnessrl.store import SQLiteStore
from tests.support.gateway import GatewayHandle, ThreadServer

REPO = Path(__file__).resolve().parents[2]
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}  # fmt: skip
ANSWER = "The secret word is plum."
SCRIPT = Script(steps=[ScriptStep(text="Let me look.", tools=[ToolStep(name="read_file", arguments={"path": "notes.txt"})]),
                       ScriptStep(text=ANSWER)], fallback="A title.")  # fmt: skip


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The replay engine as its own process, with SmolLM2's tokenizer."""
    port = free_port()
    args = ["bench.harnesses.replay_engine", "--port", str(port), "--tokenizer", str(smollm2_tokenizer_dir())]
    svc = start_service(
        "replay", args, port, tmp_path_factory.mktemp("replay-logs"), env={"PYTHONPATH": str(REPO)}
    )
    try:
        svc.wait_healthy(120)
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def gateway(request: pytest.FixtureRequest, replay: Service, tmp_path: Path) -> Iterator[GatewayHandle]:
    """A gateway in the mode the test is parametrised with, upstream = the replay engine."""
    admin = "admin-" + secrets.token_hex(8)
    cfg = GatewayConfig(admin_key=admin, upstream_url=replay.url, mode=request.param,
                        tokenizer_path=str(smollm2_tokenizer_dir()))  # fmt: skip
    store = SQLiteStore(tmp_path / "store.sqlite")
    with ThreadServer(create_app(cfg, store)) as srv:
        handle = GatewayHandle(srv.url, admin, store, replay.url)
        MODES[id(handle)] = request.param
        yield handle


MODES: dict[int, str] = {}


def gateway_mode(gw: GatewayHandle) -> str:
    """The mode a `gateway` fixture was started in."""
    return MODES[id(gw)]


def test_script_selection() -> None:
    tools = render_chat([{"role": "user", "content": "hi"}], [TOOL])
    assert declared_tools(tools) == ["read_file"] and prompt_step(tools) == 0
    assert scripted_answer(SCRIPT, tools)[0] == "Let me look." + render_tool_call(
        "read_file", {"path": "notes.txt"}
    )
    side_call = render_chat([{"role": "user", "content": "Title this conversation"}])
    assert scripted_answer(SCRIPT, side_call) == ("A title.", "fallback")
    later = render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                         {"role": "tool", "content": "y"}, {"role": "assistant", "content": "z"},
                         {"role": "user", "content": "again"}], [TOOL])  # fmt: skip
    assert prompt_step(later) == 2 and scripted_answer(SCRIPT, later) == (ANSWER, "step 2")


def test_max_tokens_and_stop_strings(replay: Service) -> None:
    httpx.post(f"{replay.url}/admin/script", json=SCRIPT.model_dump()).raise_for_status()
    tok = TitoTokenizer.from_dir(str(smollm2_tokenizer_dir()))
    prompt = tok.encode(render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                     {"role": "user", "content": "b"}]))  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 3, "logprobs": 1, "return_token_ids": True}
    cut = httpx.post(f"{replay.url}/v1/completions", json=body).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["token_ids"] == tok.encode(ANSWER)[:3]
    stopped = httpx.post(
        f"{replay.url}/v1/completions", json={**body, "max_tokens": 50, "stop": [" word"]}
    ).json()
    choice = stopped["choices"][0]
    assert (
        choice["text"] == "The secret"
        and choice["stop_reason"] == " word"
        and choice["finish_reason"] == "stop"
    )
    assert stopped["prompt_token_ids"] == prompt and choice["logprobs"]["token_logprobs"] == [0.0] * len(
        choice["token_ids"]
    )
    whole = httpx.post(f"{replay.url}/v1/completions", json={**body, "max_tokens": 50}).json()["choices"][0]
    assert whole["text"] == ANSWER and whole["token_ids"] == [*tok.encode(ANSWER), tok.eos_id]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("gateway", ["passthrough", "tito"], indirect=True)
def test_openai_sdk_tool_loop(gateway: GatewayHandle, stream: bool) -> None:
    httpx.post(f"{gateway.engine_url}/admin/script", json=SCRIPT.model_dump()).raise_for_status()
    rid, key = gateway.new_rollout()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the secret word in notes.txt?"}]

    def ask() -> tuple[str, list[dict[str, Any]]]:
        """One call; the answer's text and tool calls (streamed deltas joined by index)."""
        if not stream:
            reply = client.chat.completions.create(model="any-model", messages=messages, tools=[TOOL])  # type: ignore[arg-type,list-item]
            msg = reply.choices[0].message
            return msg.content or "", [tc.model_dump() for tc in msg.tool_calls or []]
        text, calls = "", {}  # type: ignore[var-annotated]
        for chunk in client.chat.completions.create(
            model="any-model", messages=messages, tools=[TOOL], stream=True
        ):  # type: ignore[arg-type,list-item]
            delta = chunk.choices[0].delta if chunk.choices else None
            text += (delta.content or "") if delta else ""
            for tc in (delta.tool_calls or []) if delta else []:
                slot = calls.setdefault(tc.index, {"id": "", "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                slot["function"]["name"] += (tc.function.name or "") if tc.function else ""
                slot["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        return text, [calls[i] for i in sorted(calls)]

    text, calls = ask()
    assert text == "Let me look." and len(calls) == 1
    assert (
        calls[0]["function"]["name"] == "read_file"
        and calls[0]["function"]["arguments"] == '{"path": "notes.txt"}'
    )  # type: ignore[index]
    messages.append({"role": "assistant", "content": text, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": calls[0]["function"]}]})  # fmt: skip
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "The secret word is plum."})
    final, more = ask()
    assert final == ANSWER and not more

    tok = TitoTokenizer.from_dir(str(smollm2_tokenizer_dir()))
    first, second = gateway.store.calls(rid)
    assert first.prompt_ids == tok.encode(render_chat(messages[:1], [TOOL]))  # type: ignore[arg-type]
    assert first.completion_ids == [
        *tok.encode(scripted_answer(SCRIPT, render_chat(messages[:1], [TOOL]))[0]),
        tok.eos_id,
    ]  # type: ignore[arg-type]
    assert first.completion_logprobs == [0.0] * len(first.completion_ids)
    seen = tok.tokenizer.decode(second.prompt_ids, skip_special_tokens=False)
    assert seen.endswith("<|im_start|>tool\nThe secret word is plum.<|im_end|>\n<|im_start|>assistant\n")
    assert second.completion_ids == [*tok.encode(ANSWER), tok.eos_id]
    merged = merge_calls([first, second])
    assert len(merged.rows) == 1 and merged.breaks == []  # the second prompt extends the first call exactly


@pytest.mark.parametrize("gateway", ["passthrough", "tito"], indirect=True)
def test_compact_tool_call_merges_only_in_tito(gateway: GatewayHandle) -> None:
    """A tool call written as compact JSON comes back from the harness as a parsed call: passthrough
    renders it with the template's spacing (other tokens, a `retokenized` break), tito reuses the
    tokens the model produced (one row)."""
    compact = SCRIPT.model_copy(update={"compact": True})
    httpx.post(f"{gateway.engine_url}/admin/script", json=compact.model_dump()).raise_for_status()
    rid, key = gateway.new_rollout()
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the secret word in notes.txt?"}]
    msg = client.chat.completions.create(model="m", messages=messages, tools=[TOOL]).choices[0].message  # type: ignore[arg-type,list-item]
    assert msg.tool_calls and json.loads(msg.tool_calls[0].function.arguments) == {"path": "notes.txt"}  # type: ignore[union-attr]
    messages += [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "plum"},
    ]
    assert (
        client.chat.completions.create(model="m", messages=messages, tools=[TOOL]).choices[0].message.content
        == ANSWER
    )  # type: ignore[arg-type,list-item]
    calls = gateway.store.calls(rid)
    tok = TitoTokenizer.from_dir(str(smollm2_tokenizer_dir()))
    written = tok.tokenizer.decode(calls[0].completion_ids, skip_special_tokens=True)
    assert (
        written == 'Let me look.<tool_call>{"name":"read_file","arguments":{"path":"notes.txt"}}</tool_call>'
    )
    merged = merge_calls(calls)
    if gateway_mode(gateway) == "tito":
        assert len(merged.rows) == 1 and merged.breaks == []
    else:
        assert len(merged.rows) == 2 and [str(b) for b in merged.breaks] == ["retokenized"]
