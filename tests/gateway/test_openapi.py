"""The gateway's OpenAPI document is generated from the routes that exist: every route the app serves
is in the document with its method, and the document names no route the app lacks."""

from __future__ import annotations

from starlette.routing import Route

from harnessrl.gateway.app import create_app, gateway_openapi
from harnessrl.gateway.openapi import openapi_path
from harnessrl.gateway.state import GatewayConfig
from harnessrl.store import SQLiteStore


def test_the_document_lists_exactly_the_routes_the_app_serves(tmp_path) -> None:
    app = create_app(GatewayConfig(admin_key="k" * 16), SQLiteStore(tmp_path / "s.sqlite"))
    served = {
        (openapi_path(r.path), m.lower())
        for r in app.routes
        if isinstance(r, Route)
        for m in (r.methods or ())
        if m != "HEAD"
    }
    doc = gateway_openapi()
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented
    # the routes the hand-written document used to miss
    assert ("/control/events", "get") in documented
    assert ("/r/{rollout_id}/v1/chat/completions", "post") in documented
    events = doc["paths"]["/control/events"]["get"]
    assert "text/event-stream" in events["responses"]["200"]["content"]
    assert events["security"] == [{"adminKey": []}]
    finish = doc["paths"]["/control/rollouts/{rollout_id}/attempts/{attempt}/finish"]["post"]
    assert [p["name"] for p in finish["parameters"]] == ["rollout_id", "attempt"]
    assert finish["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/AttemptFinish")
    assert "AttemptFinish" in doc["components"]["schemas"]


def test_fixed_paths_skip_the_router_and_answer_as_it_would(tmp_path) -> None:
    """`GatewayApp` serves fixed paths from its table; other methods, paths with parameters and unknown
    paths still go through Starlette, with the same error answers."""
    from starlette.testclient import TestClient

    app = create_app(GatewayConfig(admin_key="k" * 16), SQLiteStore(tmp_path / "s.sqlite"))
    through_starlette: list[str] = []
    with TestClient(app) as client:
        assert client.get("/health").json() == {"ok": True}
        stack = app.middleware_stack
        assert stack is not None

        async def counted(scope, receive, send):  # type: ignore[no-untyped-def]
            through_starlette.append(f"{scope['method']} {scope['path']}")
            await stack(scope, receive, send)

        app.middleware_stack = counted
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 401 and r.json()["error"]["type"]  # the route's own guard answered
        assert client.get("/health").status_code == 200
        assert client.post("/v1/messages", json={}).status_code == 401
        assert through_starlette == []
        r = client.get("/v1/chat/completions")
        assert r.status_code == 405 and "method GET not allowed" in r.json()["error"]["message"]
        assert client.post("/r/nope/v1/chat/completions", json=chat).status_code == 401
        assert client.get("/no/such/route").status_code == 404
        assert client.head("/health").status_code == 200
        assert through_starlette == [
            "GET /v1/chat/completions", "POST /r/nope/v1/chat/completions", "GET /no/such/route", "HEAD /health"
        ]  # fmt: skip
