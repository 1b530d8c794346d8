"""Recorded request bodies of the real CLI harnesses (Claude Code, Codex CLI, OpenCode), replayed through
the real gateway over loopback HTTP in front of a real engine: each is answered 200 and recorded with
token IDs, the fields the gateway ignores are reported, the tools are mapped (Codex namespaces and
freeform tools, hosted tools dropped), an output budget past the context is clamped and a prompt past
it gets the API's own error. Then unit tests of the pure translation functions.

The bodies are in tests/fixtures/clients/<client>-<version>/ (see record_all.sh there). Their prompts are
long (Claude Code ~12k tokens), so the engine here serves a one-layer tiny model (SmolLM2's real
tokenizer) whose context is set to CONTEXT: Claude Code's first request leaves it 80 tokens of room.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.chat import render_chat
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.budget import clamp
from harnessrl.gateway.canonical import Generation, Sampling, TokenRecord
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.errors import APIError, ErrorLog
from harnessrl.gateway.faces import ResponseIds
from harnessrl.gateway.faces import anthropic as anthropic_face
from harnessrl.gateway.faces import responses as responses_face
from harnessrl.gateway.faces.fields import ignored_fields
from harnessrl.gateway.faces.models import model_list, wants_anthropic
from harnessrl.gateway.faces.tools import anthropic_tools, custom_input, responses_tools
from harnessrl.gateway.metrics import Metrics
from harnessrl.modeling.loading import make_tiny_model_dir
from harnessrl.services import Service, free_port, start_engine
from harnessrl.store import SQLiteStore
from tests.support.gateway import GatewayHandle, ThreadServer
from tests.support.workers import torch_threads

FIXTURES = Path(__file__).parents[1] / "fixtures" / "clients"
CONTEXT = 12_360
CC, CX, OC = "claude-code-2.1.332", "codex-0.171.0", "opencode-1.18.33"
CODEX_IGNORED = {
    "client_metadata",
    "include",
    "parallel_tool_calls",
    "prompt_cache_key",
    "reasoning",
    "store",
}
# fixture -> the fields the gateway must report as ignored
REPLAYED: dict[str, set[str]] = {
    f"{CC}/messages-default-1.json": {"context_management", "metadata", "output_config", "thinking"},
    f"{CC}/messages-default-2-tool-result.json": {
        "context_management",
        "metadata",
        "output_config",
        "thinking",
    },
    f"{CX}/responses-1.json": CODEX_IGNORED,
    f"{CX}/responses-2-tool-result.json": CODEX_IGNORED,
    f"{CX}/responses-namespace-call-2-tool-result.json": CODEX_IGNORED,
    f"{CX}/responses-gpt-5.5-custom-call-1.json": CODEX_IGNORED | {"text"},
    f"{CX}/responses-gpt-5.5-custom-call-2-tool-result.json": CODEX_IGNORED | {"text"},
    f"{OC}/chat-title.json": set(),
    f"{OC}/chat-1.json": set(),
    f"{OC}/chat-2-tool-result.json": set(),
    f"{OC}/messages-title.json": set(),
    f"{OC}/messages-1.json": set(),
    f"{OC}/messages-2-tool-result.json": set(),
}


def recorded(name: str) -> dict[str, Any]:
    """A recorded request: method, path, headers (no credentials), body."""
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny Llama (real SmolLM2 tokenizer) whose positions reach past CONTEXT."""
    d = make_tiny_model_dir(tmp_path_factory.mktemp("long-tiny"), seed=0, hidden=32, layers=1, heads=2,
                            kv_heads=1, intermediate=64)  # fmt: skip
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 32768}))
    return d


@pytest.fixture(scope="module")
def long_engine(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real engine process on that model with a CONTEXT-token context (8 slots of prefix cache)."""
    svc = start_engine(
        long_model_dir, free_port(), tmp_path_factory.mktemp("long-engine"), 8, CONTEXT, torch_threads()
    )
    try:
        svc.wait_healthy(120)
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def gateways(
    long_engine: Service, long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], GatewayHandle]]:
    """One gateway per mode (passthrough, tito) in front of the long engine, made on first use."""
    made: dict[str, tuple[ThreadServer, GatewayHandle]] = {}

    def get(mode: str) -> GatewayHandle:
        if mode not in made:
            admin = "admin-" + secrets.token_hex(8)
            store = SQLiteStore(tmp_path_factory.mktemp(f"store-{mode}") / "store.sqlite")
            cfg = GatewayConfig(admin_key=admin, upstream_url=long_engine.url, mode=mode,  # type: ignore[arg-type]
                                tokenizer_path=str(long_model_dir), default_max_tokens=8)  # fmt: skip
            srv = ThreadServer(create_app(cfg, store)).__enter__()
            made[mode] = (srv, GatewayHandle(srv.url, admin, store, long_engine.url))
        return made[mode][1]

    yield get
    for srv, _ in made.values():
        srv.__exit__()


def replay(gw: GatewayHandle, key: str, rec: dict[str, Any]) -> httpx.Response:
    """Send a recorded request as its client sent it (path, API headers, body) with `key`."""
    keep = {k: v for k, v in rec["headers"].items() if k.startswith("anthropic-") or k == "content-type"}
    auth = {"x-api-key": key} if "anthropic-version" in keep else {"authorization": f"Bearer {key}"}
    return httpx.post(gw.url + rec["path"], json=rec["body"], headers={**keep, **auth}, timeout=300)


def stream_ended(face_path: str, text: str) -> bool:
    """True when a streamed answer ended the way its API ends one."""
    if "/messages" in face_path:
        return "event: message_stop" in text
    if "/responses" in face_path:
        return "event: response.completed" in text or "event: response.incomplete" in text
    return text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("mode", ["tito", "passthrough"])
@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_recorded_request_is_served_and_recorded(
    gateways: Callable[[str], GatewayHandle], long_model_dir: Path, name: str, mode: str
) -> None:
    gw, rec = gateways(mode), recorded(name)
    clamped = name.startswith(CC)  # Claude Code asks for 128,000 tokens: its budget is cut to the room left
    rid, key = gw.new_rollout(**({} if clamped else {"sampling": {"max_tokens": 4}}))
    r = replay(gw, key, rec)
    assert r.status_code == 200, r.text
    assert stream_ended(rec["path"], r.text)
    (call,) = gw.store.calls(rid)
    assert (
        call.status == "ok"
        and call.completion_ids
        and len(call.completion_logprobs) == len(call.completion_ids)
    )
    assert call.request == rec["body"]  # recorded as sent, ignored fields included
    chat = call.chat or {}
    assert set(chat.get("ignored_fields", [])) == REPLAYED[name]
    tok = TitoTokenizer.from_dir(str(long_model_dir))
    assert call.prompt_ids == tok.encode(render_chat(chat["messages"], tools=chat["tools"]))
    if clamped:
        room = CONTEXT - len(call.prompt_ids)
        assert chat["max_tokens_clamped"] == {"requested": 128000, "served": room,
                                              "prompt_tokens": len(call.prompt_ids), "context": CONTEXT}  # fmt: skip
        assert len(call.completion_ids) <= room
        if len(call.completion_ids) == room:  # cut by the context, not by the client's own maximum
            assert (call.response or {})["stop_reason"] == "model_context_window_exceeded"
    else:
        assert "max_tokens_clamped" not in chat


def test_claude_code_system_turn_and_tools(gateways: Callable[[str], GatewayHandle]) -> None:
    gw = gateways("tito")
    rid, key = gw.new_rollout(sampling={"max_tokens": 2})
    rec = recorded(f"{CC}/messages-default-2-tool-result.json")
    assert replay(gw, key, rec).status_code == 200
    (call,) = gw.store.calls(rid)
    messages = (call.chat or {})["messages"]
    # the `system` turn Claude Code puts inside `messages` stays a system turn at its place
    assert [m["role"] for m in messages] == ["system", "user", "system", "assistant", "tool"]
    assert messages[2]["content"] == rec["body"]["messages"][1]["content"]
    assert messages[3]["tool_calls"][0]["function"]["name"] == "Bash" and messages[4]["content"] == "a.txt"
    names = [t["function"]["name"] for t in (call.chat or {})["tools"]]
    assert "Bash" in names and "DeferredToolPlaceholder" not in names  # deferred until a tool_reference
    assert (call.chat or {})["dropped_tools"][0]["name"] == "DeferredToolPlaceholder"


def test_codex_namespace_and_freeform_tools_round_trip(gateways: Callable[[str], GatewayHandle]) -> None:
    gw = gateways("tito")
    rid, key = gw.new_rollout(sampling={"max_tokens": 2})
    for name in (
        "responses-namespace-call-2-tool-result.json",
        "responses-gpt-5.5-custom-call-2-tool-result.json",
    ):
        assert replay(gw, key, recorded(f"{CX}/{name}")).status_code == 200
    ns_call, custom_call = gw.store.calls(rid)
    ns_tools = {t["function"]["name"] for t in (ns_call.chat or {})["tools"]}
    assert {"exec_command", "multi_agent_v1.close_agent", "multi_agent_v1.spawn_agent"} <= ns_tools
    assert [t["type"] for t in (ns_call.chat or {})["dropped_tools"]] == ["web_search"]
    calls = [tc for m in (ns_call.chat or {})["messages"] for tc in m.get("tool_calls") or []]
    assert calls[-1]["function"] == {
        "name": "multi_agent_v1.close_agent",
        "arguments": '{"target":"agent-1"}',
    }
    tools = {t["function"]["name"]: t["function"] for t in (custom_call.chat or {})["tools"]}
    assert (
        tools["apply_patch"]["parameters"]["required"] == ["input"]
        and "lark" in tools["apply_patch"]["description"]
    )
    assert "tool_search" in tools  # Codex runs its tool search itself: a function the model can call
    messages = (custom_call.chat or {})["messages"]
    patch = json.loads(messages[-2]["tool_calls"][0]["function"]["arguments"])["input"]
    assert patch.startswith("*** Begin Patch") and messages[-1]["content"].startswith("Exit code: 0")


def test_a_prompt_past_the_context_gets_the_apis_error(
    gateways: Callable[[str], GatewayHandle], long_model_dir: Path
) -> None:
    gw = gateways("passthrough")
    rid, key = gw.new_rollout()
    rec = recorded(f"{CC}/messages-sonnet-4-5-1.json")  # Sonnet 4.5's prompt is ~21k tokens
    r = replay(gw, key, rec)
    req = anthropic_face.parse_request(rec["body"])
    chat = anthropic_face.to_chat_call(req)
    n = len(TitoTokenizer.from_dir(str(long_model_dir)).encode(render_chat(chat.messages, chat.tools)))
    assert r.status_code == 400 and n > CONTEXT
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": f"prompt is too long: {n} tokens > {CONTEXT - 1} maximum"}}  # fmt: skip
    body = recorded(f"{CX}/responses-1.json")["body"]
    long_input = [*body["input"], {"type": "message", "role": "user", "content": "hello " * CONTEXT}]
    r = httpx.post(f"{gw.url}/v1/responses", json={**body, "input": long_input},
                   headers={"authorization": f"Bearer {key}"}, timeout=300)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input" and gw.store.calls(rid) == []


def test_count_tokens_models_metrics_and_error_log(
    gateways: Callable[[str], GatewayHandle], long_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = TitoTokenizer.from_dir(str(long_model_dir))
    body = recorded(f"{OC}/messages-1.json")["body"]
    chat = anthropic_face.to_chat_call(anthropic_face.parse_request(body))
    expected = len(tok.encode(render_chat(chat.messages, chat.tools)))
    for mode in ("tito", "passthrough"):
        gw = gateways(mode)
        _, key = gw.new_rollout()
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        counted = {k: v for k, v in body.items() if k != "max_tokens"}
        r = httpx.post(f"{gw.url}/v1/messages/count_tokens", json=counted, headers=headers)
        assert r.status_code == 200 and r.json() == {"input_tokens": expected}
    models = httpx.get(f"{gw.url}/v1/models", headers=headers).json()
    assert models["data"][0]["type"] == "model" and models["has_more"] is False
    openai_models = httpx.get(f"{gw.url}/v1/models", headers={"authorization": f"Bearer {key}"}).json()
    assert openai_models["object"] == "list" and openai_models["data"][0]["object"] == "model"
    card = httpx.get(f"{gw.url}/v1/models/claude-opus-4-5", headers=headers).json()
    assert card["id"] == "claude-opus-4-5" and "smollm2" in card["display_name"]
    # a typo'd or unknown field is accepted and reported, never a 400
    rid, key = gw.new_rollout(sampling={"max_tokens": 2})
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "temprature": 1})  # fmt: skip
    assert r.status_code == 200 and (gw.store.calls(rid)[0].chat or {})["ignored_fields"] == ["temprature"]
    text = httpx.get(f"{gw.url}/metrics", headers={"authorization": f"Bearer {gw.admin_key}"}).text
    assert 'harnessrl_gateway_ignored_fields_total{face="openai.chat",field="temprature"} 1' in text
    with caplog.at_level(logging.WARNING, logger="harnessrl.gateway.app"):
        for _ in range(3):
            httpx.post(f"{gw.url}/v1/messages", json={"model": "m"}, headers={"x-api-key": "sk-bad"})
    lines = [r.getMessage() for r in caplog.records if "event=http_error" in r.getMessage()]
    assert len(lines) == 1 and "status=401" in lines[0] and "invalid API key" in lines[0]


# pure functions ---------------------------------------------------------------------------------------
def _gen(*calls: tuple[str, str]) -> Generation:
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate(calls)]  # fmt: skip
    return Generation("", tool_calls, "tool_calls", TokenRecord([1], [2], [-0.1], "stop", None))


def test_model_calls_map_back_to_the_shape_of_the_tool_called() -> None:
    tools = responses_tools([
        {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
            {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
            {"type": "custom", "name": "note"}]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
        {"type": "local_shell"}, {"type": "computer_use_preview", "display_width": 10}, {"type": "file_search"},
    ])  # fmt: skip
    assert [t["function"]["name"] for t in tools.functions] == ["crm.lookup", "crm.note", "apply_patch",
                                                                "local_shell", "computer"]  # fmt: skip
    assert [d["type"] for d in tools.dropped] == ["file_search"]
    gen = _gen(("crm.lookup", '{"id": 7}'), ("crm.note", '{"input": "hi"}'), ("apply_patch", '"*** Begin"'),
               ("local_shell", '{"command": ["ls"]}'), ("computer", '{"action": {"type": "screenshot"}}'),
               ("unknown.tool", "{}"))  # fmt: skip
    items = responses_face.output_items(gen, ResponseIds("r1", 0), tools)
    assert items[0] == {"type": "function_call", "id": "fc_r1_0", "call_id": "call_0", "status": "completed",
                        "name": "lookup", "arguments": '{"id": 7}', "namespace": "crm"}  # fmt: skip
    assert (items[1]["type"], items[1]["input"], items[1]["namespace"]) == ("custom_tool_call", "hi", "crm")
    assert items[2]["input"] == "*** Begin" and "namespace" not in items[2]
    assert items[3]["action"] == {"type": "exec", "command": ["ls"]}
    assert items[4]["type"] == "computer_call" and items[4]["action"] == {"type": "screenshot"}
    assert (items[5]["name"], items[5]["namespace"]) == ("tool", "unknown")


def test_streamed_custom_tool_call_events() -> None:
    body = {"model": "m", "input": "x", "stream": True, "tools": [{"type": "custom", "name": "apply_patch"}]}
    req = responses_face.parse_request(body)
    gen = _gen(("apply_patch", '{"input": "patch text"}'))
    out = responses_face.response_object(gen, req, ResponseIds("r2", 0))
    frames = responses_face.ResponseStreamer(req, ResponseIds("r2", 0)).end(gen, out)
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert kinds == ["response.output_item.added", "response.custom_tool_call_input.delta",
                     "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert json.loads(frames[2].split("data: ")[1])["input"] == "patch text"


def test_anthropic_tools_of_every_kind() -> None:
    tools = anthropic_tools([
        {"name": "Read", "input_schema": {"type": "object", "properties": {}}},
        {"type": "bash_20250124", "name": "bash"}, {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, {"type": "mystery_20990101", "name": "m"},
        {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
        {"name": "Loaded", "input_schema": {"type": "object"}, "defer_loading": True},
    ], loaded={"Loaded"})  # fmt: skip
    names = [t["function"]["name"] for t in tools.functions]
    assert names == ["Read", "bash", "str_replace_based_edit_tool", "Loaded"]
    assert tools.functions[1]["function"]["parameters"]["required"] == ["command"]
    assert [(d["type"], d["name"]) for d in tools.dropped] == [("web_search_20250305", "web_search"),
                                                               ("mystery_20990101", "m"), ("deferred", "Later")]  # fmt: skip
    with pytest.raises(APIError, match=r"tools\.0\.input_schema"):
        anthropic_tools([{"name": "NoSchema"}])
    with pytest.raises(APIError, match=r"tools\.0\.name"):
        anthropic_tools([{"name": "bad name!", "input_schema": {"type": "object"}}])


def test_anthropic_turns_blocks_and_fields() -> None:
    body = {"model": "claude-x", "max_tokens": 10, "thinking": {"type": "adaptive"}, "betas": ["x"],
            "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image", "source": {"type": "base64", "data": "AA"}}]},
                {"role": "system", "content": "mid"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "tool_reference", "tool_name": "Later"}]}]}],
            "tools": [{"name": "ToolSearch", "input_schema": {"type": "object"}},
                      {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}]}  # fmt: skip
    req = anthropic_face.parse_request(body)
    chat = anthropic_face.to_chat_call(req)
    assert chat.messages == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "look[image]"},
        {"role": "system", "content": "mid"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "ToolSearch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "[tool loaded: Later]"},
    ]  # fmt: skip
    assert [t["function"]["name"] for t in chat.tools or []] == ["ToolSearch", "Later"]
    assert anthropic_face.AnthropicFace().describe(req) == {"ignored_fields": ["betas", "thinking"]}
    with pytest.raises(APIError, match="temperature"):
        anthropic_face.parse_request({**body, "temperature": "hot"})  # a field it uses, malformed


def test_anthropic_stop_reason_tells_the_clients_maximum_from_the_gateways_cut() -> None:
    cut = Generation("text", [], "length", TokenRecord([1], [2, 3], [-0.1, -0.2], "length", None))
    assert anthropic_face.stop_reason(cut, 2) == "max_tokens"  # the request's own max_tokens
    assert anthropic_face.stop_reason(cut, 32000) == "model_context_window_exceeded"  # clamped or capped
    assert anthropic_face.stop_reason(_gen(("Bash", "{}")), 32000) == "tool_use"


def test_ignored_fields_and_custom_input() -> None:
    used = frozenset({"model", "input"})
    assert ignored_fields({"model": "m", "input": "x", "store": False, "metadata": None, "zzz": 1}, used) == [
        "store",
        "zzz",
    ]
    assert (
        custom_input('{"input": "a"}') == "a"
        and custom_input('"b"') == "b"
        and custom_input("raw {") == "raw {"
    )
    assert custom_input('{"patch": "c"}') == "c" and custom_input('{"a": 1}') == '{"a": 1}'


def test_clamp_and_too_long() -> None:
    s = Sampling(max_tokens=1000, temperature=1.0, top_p=None, seed=None, stop=None)
    assert clamp(100, s, 2048, "openai").clamped is None
    fit = clamp(1500, s, 2048, "openai")
    assert fit.sampling.max_tokens == 548 and fit.clamped == {"requested": 1000, "served": 548,
                                                               "prompt_tokens": 1500, "context": 2048}  # fmt: skip
    with pytest.raises(APIError) as e:
        clamp(2048, s, 2048, "anthropic")
    assert e.value.message == "prompt is too long: 2048 tokens > 2047 maximum"
    with pytest.raises(APIError) as e:
        clamp(3000, s, 2048, "openai", "input")
    assert (
        e.value.code == "context_length_exceeded" and e.value.param == "input" and "2048" in e.value.message
    )


def test_error_log_rate_limit_and_model_shapes(caplog: pytest.LogCaptureFixture) -> None:
    log = ErrorLog(logging.getLogger("test.errors"), window_s=60.0)
    with caplog.at_level(logging.WARNING, logger="test.errors"):
        assert log.report("POST", "/v1/messages", 400, "bad") is True
        assert [log.report("POST", "/v1/messages", 400, "bad") for _ in range(4)] == [False] * 4
        assert log.report("POST", "/v1/messages", 400, "other") is True
    assert len(caplog.records) == 2 and "reason='bad'" in caplog.records[0].getMessage()
    log.window_s = 0.0
    assert log.report("POST", "/v1/messages", 400, "bad") is True
    assert "suppressed=4" in caplog.records[-1].getMessage()
    assert wants_anthropic({"anthropic-version": "2023-06-01"}) and wants_anthropic({"x-api-key": "k"})
    assert not wants_anthropic({"authorization": "Bearer k"})
    listing = model_list(["a", "b"], True, {"a": "s", "b": "s"})
    assert (listing["first_id"], listing["last_id"], listing["data"][0]["type"]) == ("a", "b", "model")
    m = Metrics()
    for i in range(5):
        m.inc_capped("x_total", "help", 2, field=f'f"{i}')
    text = m.render()
    assert 'x_total{field="f\\"0"} 1' in text and 'x_total{field="other"} 3' in text
