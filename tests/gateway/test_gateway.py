"""The gateway over a real engine (tiny model, real tokenizer), driven by the official openai SDK."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from openai import OpenAI

from harnessrl.chat import render_chat
from harnessrl.modeling.loading import load_tokenizer
from harnessrl.schema import CallStatus, RolloutState
from tests.support.gateway import GatewayHandle

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def sdk(gw: GatewayHandle, key: str, prefix: str = "") -> OpenAI:
    return OpenAI(base_url=f"{gw.url}{prefix}/v1", api_key=key, max_retries=0)


def test_call_is_recorded_with_the_engines_exact_tokens(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir
) -> None:  # type: ignore[no-untyped-def]
    gw = make_gateway()
    rid, key = gw.new_rollout(sampling={"temperature": 0.7})
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    resp = sdk(gw, key).chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, max_tokens=12)  # type: ignore[arg-type]
    assert resp.model == "gpt-4o" and resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.OK and call.weight_version == 0 and call.temperature == 0.7
    tok = load_tokenizer(tiny_model_dir)
    rendered = render_chat(messages, tools=TOOLS, add_generation_prompt=True)
    assert call.prompt_ids == tok.encode(rendered, add_special_tokens=False).ids
    engine_tokens = httpx.post(
        f"{gw.engine_url}/tokenize", json={"messages": messages, "tools": TOOLS}
    ).json()
    assert call.prompt_ids == engine_tokens["tokens"]
    assert len(call.completion_ids) == len(call.completion_logprobs) == resp.usage.completion_tokens  # type: ignore[union-attr]
    # Special tokens (<|im_end|>, or one the random tiny model samples mid-text) are sampled but not shown.
    assert tok.decode(call.completion_ids, skip_special_tokens=True) == (
        resp.choices[0].message.content or ""
    )
    assert call.request["messages"] == messages and call.response is not None
    assert "prompt_token_ids" not in resp.model_dump() or resp.model_dump().get("prompt_token_ids") is None


def test_keys_are_scoped_to_their_rollout(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid_a, key_a = gw.new_rollout()
    rid_b, key_b = gw.new_rollout()
    msgs = [{"role": "user", "content": "hi"}]
    sdk(gw, key_a).chat.completions.create(model="m", messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    sdk(gw, key_b, prefix=f"/r/{rid_b}").chat.completions.create(model="m", messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    assert [c.rollout_id for c in gw.store.calls(rid_a)] == [rid_a]
    assert [c.rollout_id for c in gw.store.calls(rid_b)] == [rid_b]
    with pytest.raises(openai.PermissionDeniedError):  # A's key on B's URL
        sdk(gw, key_a, prefix=f"/r/{rid_b}").chat.completions.create(model="m", messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        sdk(gw, key_a[:-4] + "0000").chat.completions.create(model="m", messages=msgs, max_tokens=3)  # type: ignore[arg-type]
    # a rollout key cannot read or write anything on the control API, its own rollout included
    for method, path in [("GET", f"/control/rollouts/{rid_b}"), ("GET", f"/control/rollouts/{rid_a}"),
                         ("PUT", f"/control/rollouts/{rid_a}/reward"), ("GET", "/control/rollouts")]:  # fmt: skip
        r = httpx.request(
            method, gw.url + path, headers={"Authorization": f"Bearer {key_a}"}, json={"value": 1.0}
        )
        assert r.status_code == 403, (method, path)
    assert httpx.get(f"{gw.url}/control/rollouts").status_code == 401
    assert gw.store.get_reward(rid_a) is None
    assert len(gw.store.calls(rid_a)) == 1 and len(gw.store.calls(rid_b)) == 1


BAD_BODIES = [
    (b"{not json", 400, None),
    (b'{"model": "m", "messages": "hello"}', 400, "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": "yes"}', 400, "stream_options"),
    (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
    (b'{"model": "m", "messages": []}', 400, "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}', 400, "tools.0.function.name"),
    (b"[1, 2, 3]", 400, None),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES)
def test_bad_input_gets_a_clear_4xx_and_records_nothing(
    make_gateway: Callable[..., GatewayHandle], body: bytes, status: int, param: str | None
) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    assert gw.store.calls(rid) == []


def test_missing_key_unknown_rollout_and_oversized_body(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway(max_body_bytes=2000)
    rid, key = gw.new_rollout()
    ok = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert (
        httpx.post(f"{gw.url}/v1/chat/completions", json=ok).json()["error"]["type"] == "authentication_error"
    )
    r = httpx.post(
        f"{gw.url}/r/ro0000/v1/chat/completions", json=ok, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 403
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 413 and gw.store.calls(rid) == []
    with gw.admin() as c:
        assert c.get("/control/rollouts/ro0000").status_code == 404
        assert c.put("/control/rollouts/ro0000/reward", json={"value": 1}).status_code == 404


def test_finished_rollout_accepts_no_calls(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    with gw.admin() as c:
        c.post(f"/control/rollouts/{rid}/state", json={"state": "succeeded"}).raise_for_status()
        r = c.post(f"/control/rollouts/{rid}/state", json={"state": "running"})
        assert r.status_code == 409 and "succeeded" in r.json()["error"]["message"]
    with pytest.raises(openai.ConflictError):
        sdk(gw, key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


def test_control_api_create_is_idempotent_and_lists_by_state(
    make_gateway: Callable[..., GatewayHandle],
) -> None:
    gw = make_gateway()
    with gw.admin() as c:
        first = c.post("/control/rollouts", json={"client_id": "job-1", "task_id": "t1", "input": {"q": 1}})
        again = c.post("/control/rollouts", json={"client_id": "job-1", "task_id": "t1"})
        assert (first.status_code, again.status_code) == (201, 200)
        assert first.json()["api_key"] == again.json()["api_key"]
        rid = first.json()["rollout"]["rollout_id"]
        assert c.post("/control/rollouts", json={"client_id": "job-1", "task_id": "t2"}).status_code == 409
        assert (
            c.post("/control/rollouts", json={"client_id": "x", "task_id": "t", "bogus": 1}).status_code
            == 400
        )
        for i in range(4):
            c.post("/control/rollouts", json={"client_id": f"job-q{i}", "task_id": "t"}).raise_for_status()
        c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
        running = c.get("/control/rollouts", params={"state": "running"}).json()
        assert [r["rollout_id"] for r in running["rollouts"]] == [rid]
        page = c.get("/control/rollouts", params={"state": "queued", "limit": 3}).json()
        assert len(page["rollouts"]) == 3 and page["next_cursor"]
        rest = c.get("/control/rollouts", params={"state": "queued", "cursor": page["next_cursor"]}).json()
        assert len(rest["rollouts"]) == 1 and rest["next_cursor"] is None
        assert c.get("/control/rollouts", params={"state": "sideways"}).status_code == 400
        huge = str(2**64)  # past SQLite's INTEGER: a 400 naming the field, not a 500 (found by the fuzzer)
        assert c.get("/control/rollouts", params={"cursor": huge}).json()["error"]["param"] == "cursor"
        assert c.get("/control/events", params={"after": huge}).status_code == 400
        assert (
            c.post(f"/control/rollouts/{rid}/attempts/{huge}/finish", json={"status": "exited"}).status_code
            == 404
        )
        assert c.post("/control/resume", json={"weight_version": 2**64}).status_code == 400
        c.put(f"/control/rollouts/{rid}/reward", json={"value": 0.25}).raise_for_status()
        c.put(f"/control/rollouts/{rid}/reward", json={"value": 1.0, "details": {"k": 1}}).raise_for_status()
        detail = c.get(f"/control/rollouts/{rid}").json()
        assert detail["reward"]["value"] == 1.0 and detail["rollout"]["state"] == RolloutState.RUNNING
        assert c.put(f"/control/rollouts/{rid}/reward", json={"value": "high"}).status_code == 400


def test_pause_holds_calls_then_429_and_resume_records_the_version(
    make_gateway: Callable[..., GatewayHandle],
) -> None:
    gw = make_gateway(pause_wait_s=0.3)
    rid, key = gw.new_rollout()
    msgs = [{"role": "user", "content": "x"}]
    with gw.admin() as c:
        assert c.post("/control/pause", json={"drain_timeout_s": 5}).json()["drained"] is True
        r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": msgs},
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["code"] == "paused"
        assert gw.store.calls(rid) == []
        c.post("/control/resume", json={"weight_version": 0}).raise_for_status()
        assert c.get("/control/status").json() == {"paused": False, "in_flight": 0, "weight_version": 0}
    sdk(gw, key).chat.completions.create(model="m", messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    assert len(gw.store.calls(rid)) == 1


# uvicorn's own h11 protocol behaves the same; its run is in `pytest -m slow` (the suite's 15 minutes)
@pytest.mark.parametrize("http", ["gateway", pytest.param("h11", marks=pytest.mark.slow)])
def test_preempting_pause_cuts_a_generation_and_resends_it_after_resume(
    make_gateway: Callable[..., GatewayHandle], http: str
) -> None:
    """`preempt`: the pause does not wait for a long generation; the engine aborts it, the harness's
    call waits, and after resume it is generated again whole and recorded once. Under the gateway's
    own HTTP protocol the call runs in its handler's task; under another (h11) in a task of its own."""
    gw = make_gateway(**({"http": "h11"} if http == "h11" else {}))
    rid, key = gw.new_rollout()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1900}
    aborted_before = httpx.get(f"{gw.engine_url}/admin/stats").json()["aborted"]
    result: dict[str, httpx.Response] = {}

    def harness_call() -> None:
        result["r"] = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=300,
                                 headers={"Authorization": f"Bearer {key}"})  # fmt: skip

    thread = threading.Thread(target=harness_call)
    thread.start()
    with gw.admin() as c:
        deadline = time.monotonic() + 30
        while c.get("/control/status").json()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # generating now
        paused = c.post("/control/pause", json={"drain_timeout_s": 30, "preempt": True}).json()
        assert paused["drained"] is True and paused["preempted_calls"] == 1 and paused["in_flight"] == 0
        deadline = time.monotonic() + 10  # the engine notices the closed connection within 0.25 s
        while httpx.get(f"{gw.engine_url}/admin/stats").json()["aborted"] == aborted_before:
            assert time.monotonic() < deadline, "the engine did not abort the cut generation"
            time.sleep(0.05)
        assert httpx.get(f"{gw.engine_url}/admin/stats").json()["running"] == 0
        assert thread.is_alive() and gw.store.calls(rid) == []  # held, nothing recorded for the cut one
        c.post("/control/resume", json={"weight_version": 0}).raise_for_status()
    thread.join(300)
    r = result["r"]
    assert r.status_code == 200
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.OK and call.weight_version == 0
    assert len(call.completion_ids) == r.json()["usage"]["completion_tokens"] > 0


def test_upstream_failure_is_recorded_as_a_failed_call(make_gateway: Callable[..., GatewayHandle]) -> None:
    from harnessrl.services import free_port

    gw = make_gateway(upstream_url=f"http://127.0.0.1:{free_port()}", upstream_retries=1)
    rid, key = gw.new_rollout()
    with pytest.raises(openai.APIStatusError) as e:
        sdk(gw, key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 502
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.FAILED and call.error and "ConnectError" in call.error


@pytest.mark.parametrize("mode", ["passthrough", "tito"])
def test_streaming_delivers_the_recorded_answer(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir, mode: str
) -> None:  # type: ignore[no-untyped-def]
    gw = make_gateway(mode=mode, tokenizer_path=str(tiny_model_dir))
    rid, key = gw.new_rollout()
    msgs = [{"role": "user", "content": "Count to three."}]
    stream = sdk(gw, key).chat.completions.create(
        model="m",
        messages=msgs,
        tools=TOOLS,
        max_tokens=24,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    # deltas arrive as the engine samples them, not all at the end
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    (call,) = gw.store.calls(rid)
    assert text == call.response["choices"][0]["message"]["content"]  # type: ignore[index]
    assert finish == [call.response["choices"][0]["finish_reason"]]  # type: ignore[index]
    assert usage and usage[0].completion_tokens == len(call.completion_ids)
    assert call.chat is not None and call.chat["messages"] == msgs and call.face == "openai.chat"
    assert len(call.completion_logprobs) == len(call.completion_ids) and call.prompt_ids
    tok = load_tokenizer(tiny_model_dir)
    decoded = tok.decode(call.completion_ids, skip_special_tokens=True)  # special tokens are not shown
    assert decoded.startswith(text)  # a tool call, if one was sampled, comes after the content


def test_completions_face_with_text_and_token_prompts(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir
) -> None:  # type: ignore[no-untyped-def]
    gw = make_gateway()
    rid, key = gw.new_rollout()
    client = sdk(gw, key)
    text = client.completions.create(model="davinci", prompt="Once upon a time", max_tokens=5, logprobs=1)
    ids = client.completions.create(
        model="davinci", prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"return_token_ids": True}
    )
    streamed = list(
        client.completions.create(
            model="davinci", prompt="Hi", max_tokens=12, temperature=1.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    calls = gw.store.calls(rid)
    assert [c.face for c in calls] == ["openai.completions"] * 3
    assert calls[1].prompt_ids == [1, 2, 3, 4] and ids.model_extra["prompt_token_ids"] == [1, 2, 3, 4]  # type: ignore[index]
    assert text.choices[0].text == calls[0].response["choices"][0]["text"]  # type: ignore[index]
    assert text.choices[0].logprobs is not None and "prompt_token_ids" not in text.model_dump()
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == calls[2].response["choices"][0]["text"]  # type: ignore[index]
    assert sum(1 for p in pieces if p) >= 2 and streamed[-1].usage.completion_tokens == 12  # type: ignore[union-attr]
    streamed_ids = [t for c in streamed if c.choices for t in c.choices[0].model_extra["token_ids"]]  # type: ignore[index]
    assert streamed_ids == calls[2].completion_ids and len(calls[2].completion_logprobs) == 12
    assert streamed[0].model_extra["prompt_token_ids"] == calls[2].prompt_ids  # type: ignore[index]
    assert load_tokenizer(tiny_model_dir).decode(streamed_ids, skip_special_tokens=True) == "".join(pieces)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="davinci", prompt=[], max_tokens=5)
    assert len(gw.store.calls(rid)) == 3


def test_rollouts_stick_to_a_replica_and_fail_over(make_gateway: Callable[..., GatewayHandle]) -> None:
    from harnessrl.services import free_port

    # two live replicas (the same engine under two names): each rollout keeps to one of them
    gw = make_gateway(upstream_retries=0)
    gw = make_gateway(replica_urls=[gw.engine_url], upstream_retries=0)
    by_rollout = {}
    for _ in range(20):  # random rollout ids: with 8, all on one replica had a 1-in-128 chance
        rid, key = gw.new_rollout()
        for _ in range(2):
            sdk(gw, key).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        by_rollout[rid] = {c.upstream for c in gw.store.calls(rid)}
    assert all(len(names) == 1 for names in by_rollout.values())
    assert set().union(*by_rollout.values()) == {"engine0", "engine1"}
    # a dead first replica: calls fail over to the live one and are recorded with its name
    dead = f"http://127.0.0.1:{free_port()}"
    gw2 = make_gateway(upstream_url=dead, replica_urls=[gw.engine_url], upstream_retries=0)
    for _ in range(4):
        rid, key = gw2.new_rollout()
        sdk(gw2, key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert [c.upstream for c in gw2.store.calls(rid)] == ["engine1"]


@pytest.mark.parametrize("mode", ["passthrough", "tito"])
def test_usage_reports_the_prompt_tokens_the_engine_had_cached(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """The second of two calls with one long shared prefix is prefilled partly from the engine's prefix
    cache; the gateway passes the count on (`usage.prompt_tokens_details.cached_tokens`, as OpenAI),
    streamed or not."""
    gw = make_gateway(mode=mode, tokenizer_path=str(tiny_model_dir))
    _, key = gw.new_rollout()
    system = {"role": "system", "content": f"You add numbers. Session {mode} " + "one two three " * 40}
    client = sdk(gw, key)
    first = client.chat.completions.create(
        model="m", messages=[system, {"role": "user", "content": "2 + 3?"}], max_tokens=4
    )
    second = client.chat.completions.create(
        model="m", messages=[system, {"role": "user", "content": "4 + 5?"}], max_tokens=4
    )
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # the system message (~125 tokens) is shared; the differing user turn is not
    assert 100 < details.cached_tokens < second.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="m", messages=[system, {"role": "user", "content": "6 + 7?"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]  # streamed: the closing chunk
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
    assert 100 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


@pytest.mark.parametrize(("path", "http"), [("/v1/chat/completions", "gateway"), ("/v1/completions", "gateway"),
                                           ("/v1/chat/completions", "h11")])  # fmt: skip
def test_a_non_streamed_call_whose_client_hangs_up_is_cut_and_recorded_cancelled(
    make_gateway: Callable[..., GatewayHandle], path: str, http: str
) -> None:
    """The engine stops generating for nobody: the call is cut when the client goes, not run to its end
    (told by the gateway's HTTP protocol, or under another server by a task watching for the hang-up)."""
    gw = make_gateway(**({"http": "h11"} if http == "h11" else {}))
    with gw.admin() as c:
        c.post("/control/resume", json={"weight_version": 7}).raise_for_status()
    rid, key = gw.new_rollout(sampling={"temperature": 1.0})
    body: dict[str, object] = {"model": "m", "max_tokens": 1800, "seed": 1}
    if path == "/v1/completions":
        body["prompt"] = "Count: 1 2 3"
    else:
        body["messages"] = [{"role": "user", "content": "Count to a thousand."}]
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s and closes its connection
        httpx.post(f"{gw.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=0.5)
    deadline = time.monotonic() + 15
    while not gw.store.calls(rid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.CANCELLED and call.finish_reason == "cancelled"
    assert call.error == "cancelled: the client disconnected before the answer"
    assert call.weight_version == 7  # the version in force when it was cut (announced by the resume below)
    assert call.latency_s < 5, call.latency_s
    # the engine aborted the sequence: nothing of it runs any more
    deadline = time.monotonic() + 10
    while httpx.get(f"{gw.engine_url}/admin/stats").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{gw.engine_url}/admin/stats").json()["running"] == 0
    assert time.monotonic() - t0 < 15  # 1,800 tokens of the tiny model take longer than that on 2 cores
