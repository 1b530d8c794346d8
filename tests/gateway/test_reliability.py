"""Reliability of the gateway under bad input and a failing engine (issue 18), over real HTTP on
loopback against the fault engine of bench/reliability (the one engine that fails on demand): the
door's JSON policy, body and header limits, stream-open and per-call time limits, malformed engine
events, disconnected clients, and /metrics behind the admin key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from bench.reliability.fault_engine import FaultEngineThread

from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.engine_client.upstream import Upstream, UpstreamFailed, UpstreamPool
from harnessrl.schema import Call, CallStatus
from harnessrl.services import free_port
from harnessrl.store import SQLiteStore
from tests.store.test_reliability_store import nested
from tests.support.gateway import GatewayHandle, ThreadServer

MakeGateway = Callable[..., GatewayHandle]


@pytest.fixture
def fault_gateway(tmp_path: Path) -> Iterator[MakeGateway]:
    """Factory: a gateway in this process over fault engines (`faults`: one replica each)."""
    stack = contextlib.ExitStack()

    def make(faults: tuple[str, ...] = ("ok",), **overrides: Any) -> GatewayHandle:
        engines = [stack.enter_context(FaultEngineThread(free_port(), f)) for f in faults]
        admin = "admin-" + secrets.token_hex(8)
        store = SQLiteStore(tmp_path / f"store-{secrets.token_hex(3)}.sqlite")
        cfg = GatewayConfig.model_validate({"admin_key": admin, "upstream_url": engines[0].url,
                                            "replica_urls": [e.url for e in engines[1:]], **overrides})  # fmt: skip
        srv = stack.enter_context(ThreadServer(create_app(cfg, store)))
        return GatewayHandle(srv.url, admin, store, engines[0].url)

    with stack:
        yield make


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def anthropic_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": content}], **extra}


def wait_for_calls(gw: GatewayHandle, rid: str, n: int = 1) -> list[Call]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        calls = gw.store.calls(rid)
        if len(calls) >= n:
            return calls
        time.sleep(0.05)
    raise AssertionError(f"rollout {rid} has {len(gw.store.calls(rid))} calls, expected {n}")


# the door: one JSON policy for every route ----------------------------------------------------------
def test_deep_json_is_refused_in_each_api_shape_and_nothing_is_stored(fault_gateway: MakeGateway) -> None:
    gw = fault_gateway()
    rid, key = gw.new_rollout()
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat("hi", metadata=nested(100)), headers=auth)
    assert r.status_code == 400 and "deeper than 64 levels" in r.json()["error"]["message"]
    r = httpx.post(f"{gw.url}/v1/messages", json=anthropic_body("hi", metadata=nested(300)), headers=auth)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    with gw.admin() as c:
        r = c.post("/control/rollouts", json={"client_id": "x", "task_id": "t", "metadata": nested(80)})
        assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
    assert gw.store.calls(rid) == []
    # within the limit: answered, stored, and the rollout reads back through the control API
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat("hi", metadata=nested(60)), headers=auth)
    assert r.status_code == 200, r.text
    with gw.admin() as c:
        detail = c.get(f"/control/rollouts/{rid}")
        assert detail.status_code == 200 and len(detail.json()["calls"]) == 1


def test_a_hundred_thousand_messages_are_refused_at_the_door(fault_gateway: MakeGateway) -> None:
    gw = fault_gateway(max_body_bytes=16 * 1024 * 1024)
    rid, key = gw.new_rollout()
    auth = {"Authorization": f"Bearer {key}"}
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(100_000)]
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers=auth,
                   timeout=60)  # fmt: skip
    assert r.status_code == 413 and "objects/arrays" in r.json()["error"]["message"]
    r = httpx.post(f"{gw.url}/v1/messages", json={"model": "c", "max_tokens": 4, "messages": messages},
                   headers=auth, timeout=60)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": "m", "prompt": [1] * 300_000}, headers=auth,
                   timeout=60)  # fmt: skip
    assert r.status_code == 413 and "JSON values" in r.json()["error"]["message"]
    assert gw.store.calls(rid) == []


def raw_exchange(url: str, payload: bytes, pieces: list[bytes] | None = None, pause_s: float = 0.0) -> bytes:
    """Send raw bytes (then `pieces`, `pause_s` apart, without finishing), return what comes back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(payload)
        for piece in pieces or []:
            time.sleep(pause_s)
            try:
                s.sendall(piece)
            except OSError:
                break  # the server stopped reading: what matters is its answer
        answer = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer:
                    break
        return answer


def test_chunked_body_is_cut_at_the_limit_while_it_streams(fault_gateway: MakeGateway) -> None:
    gw = fault_gateway(max_body_bytes=64 * 1024)
    _, key = gw.new_rollout()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()  # fmt: skip
    chunk = b"%x\r\n%s\r\n" % (16 * 1024, b" " * 16 * 1024)
    answer = raw_exchange(gw.url, head, [chunk] * 8)  # 128 KB sent, the body never finished
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_body_that_never_completes_gets_408(
    fault_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harnessrl.gateway import http

    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 0.5)
    gw = fault_gateway()
    _, key = gw.new_rollout()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"").encode()  # fmt: skip
    answer = raw_exchange(gw.url, head)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


class ConfiguredServer:
    """The gateway app under the production uvicorn settings (`server_config`), in a thread."""

    def __init__(self, app: Any, header_timeout_s: float) -> None:
        from harnessrl.gateway.__main__ import server_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, header_timeout_s))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ConfiguredServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_slow_or_idle_connections_are_closed_and_huge_headers_refused(tmp_path: Path) -> None:
    cfg = GatewayConfig(admin_key="admin-" + secrets.token_hex(8))
    with ConfiguredServer(create_app(cfg, SQLiteStore(tmp_path / "s.sqlite")), header_timeout_s=0.5) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # the settings serve normal clients
        assert raw_exchange(srv.url, b"") == b""  # never sends a byte: closed, nothing answered
        dribble = [b"GET /health HTTP/1.1\r\n"[i : i + 1] for i in range(22)]
        assert raw_exchange(srv.url, b"", dribble, pause_s=0.1) == b""  # headers too slow: closed
        huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
        assert raw_exchange(srv.url, huge).startswith(b"HTTP/1.1 431")
        big_body = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n"
            + b" " * 300_000
        )
        assert raw_exchange(srv.url, big_body).startswith(b"HTTP/1.1 401")  # a body is not a header


# the engine's faults ---------------------------------------------------------------------------------
def first_replica(gw: GatewayHandle, rid: str, n: int) -> str:
    pool = UpstreamPool([Upstream(f"engine{i}", "http://127.0.0.1:1") for i in range(n)])
    return pool.order(rid)[0].name


def test_stream_whose_engine_never_answers_fails_over_or_is_recorded_failed(
    fault_gateway: MakeGateway,
) -> None:
    # (the gateway's context-budget lookup is a non-streamed call: it fails over after `upstream_timeout_s`)
    gw = fault_gateway(("hang", "ok"), stream_open_timeout_s=0.3, upstream_timeout_s=1, upstream_retries=1)
    rollouts = [gw.new_rollout() for _ in range(8)]
    rid, key = next((r, k) for r, k in rollouts if first_replica(gw, r, 2) == "engine0")
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=chat("hi", stream=True),
                      headers={"Authorization": f"Bearer {key}"}, timeout=20) as r:  # fmt: skip
        assert r.status_code == 200
        text = r.read().decode()
    assert "t0 " in text and "[DONE]" in text
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.OK and call.upstream == "engine1"  # failed over to the other one

    alone = fault_gateway(("hang",), stream_open_timeout_s=0.3, upstream_timeout_s=1, upstream_retries=1)
    rid, key = alone.new_rollout()
    r = httpx.post(f"{alone.url}/v1/chat/completions", json=chat("hi", stream=True),
                   headers={"Authorization": f"Bearer {key}"}, timeout=20)  # fmt: skip
    assert r.status_code == 502 and "headers" in r.json()["error"]["message"]
    (call,) = alone.store.calls(rid)
    assert call.status == CallStatus.FAILED and call.error and "2 tries" in call.error


def test_a_hung_engine_holds_a_call_no_longer_than_its_time_limit(fault_gateway: MakeGateway) -> None:
    gw = fault_gateway(("hang",), upstream_timeout_s=30, upstream_retries=3, call_timeout_s=1.0)
    rid, key = gw.new_rollout()
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat("hi"), headers={"Authorization": f"Bearer {key}"},
                   timeout=15)  # fmt: skip
    assert r.status_code == 502
    (call,) = gw.store.calls(rid)
    assert call.status == CallStatus.FAILED and call.error and "time limit" in call.error


def test_a_retry_the_time_limit_has_no_room_for_is_blamed_on_the_limit() -> None:
    """Deterministic form of the race above: a try runs out, the deadline is not yet reached but the next
    backoff would pass it; the failure says the time limit stopped the retries, and counts the one try."""

    async def main() -> str:
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
        port = silent.sockets[0].getsockname()[1]
        up = Upstream("e0", f"http://127.0.0.1:{port}", timeout_s=0.3, max_retries=3, backoff_s=30.0)
        try:
            with pytest.raises(UpstreamFailed) as caught:
                await up.post("/v1/chat/completions", chat("hi"), deadline=time.monotonic() + 5.0)
            return str(caught.value)
        finally:
            await up.aclose()
            silent.close()

    said = asyncio.run(main())
    assert "failed after 1 try:" in said and "no answer" in said and "time limit" in said


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat("fault:badevent", stream=True)),
        ("/v1/messages", anthropic_body("fault:badevent", stream=True)),
        ("/v1/completions", {"model": "m", "prompt": "fault:badevent", "stream": True}),
    ],
)
def test_a_malformed_engine_event_ends_the_stream_with_an_error_and_is_recorded(
    fault_gateway: MakeGateway, path: str, body: dict[str, Any]
) -> None:
    gw = fault_gateway()
    rid, key = gw.new_rollout()
    with httpx.stream("POST", f"{gw.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=20) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    errors = [json.loads(line[5:]) for line in lines if '"error"' in line]
    assert errors and "malformed stream event" in json.dumps(errors[-1])
    (call,) = wait_for_calls(gw, rid)
    assert call.status == CallStatus.FAILED and call.error and "malformed stream event" in call.error


@pytest.mark.parametrize("face", ["chat", "completions"])
def test_a_client_gone_mid_stream_leaves_its_call_recorded_as_cancelled(
    fault_gateway: MakeGateway, face: str
) -> None:
    gw = fault_gateway()
    rid, key = gw.new_rollout()
    path, body = (("/v1/chat/completions", chat("fault:slow", stream=True)) if face == "chat"
                  else ("/v1/completions", {"model": "m", "prompt": "fault:slow", "stream": True}))  # fmt: skip
    with httpx.stream("POST", f"{gw.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=20) as r:  # fmt: skip
        seen = 0
        for line in r.iter_lines():
            seen += '"t' in line
            if seen >= 5:
                break  # leaving the block closes the connection mid-stream
    (call,) = wait_for_calls(gw, rid)
    assert call.status == CallStatus.CANCELLED and call.finish_reason == "cancelled"
    assert call.error and call.error.startswith("cancelled: the client disconnected")
    assert 5 <= len(call.completion_ids) < 200 and len(call.completion_logprobs) == len(call.completion_ids)
    assert call.prompt_ids
    if face == "chat":
        assert call.chat is not None and call.chat["answer"]["content"].startswith("t0 t1 t2 t3 t4")


def test_metrics_need_the_admin_key(fault_gateway: MakeGateway) -> None:
    gw = fault_gateway()
    _, key = gw.new_rollout()
    assert httpx.get(f"{gw.url}/metrics").status_code == 401
    assert httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 403
    r = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {gw.admin_key}"})
    assert r.status_code == 200 and "harnessrl_gateway_in_flight" in r.text
