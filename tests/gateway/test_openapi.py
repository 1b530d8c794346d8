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
