"""A gateway that restarts during a weight update (a replica brought back by its supervisor) reads the
pause and the engine's weight version from the store: it holds calls until the resume, and records the
version the trainer last named."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx

from harnessrl.gateway.app import create_app
from harnessrl.gateway.state import GatewayConfig
from harnessrl.services import Service
from harnessrl.store import SQLiteStore
from tests.support.gateway import GatewayHandle, ThreadServer


def test_a_restarted_gateway_is_paused_with_the_stored_weight_version(
    engine: Service, tmp_path: Path
) -> None:
    store_path = tmp_path / "s.sqlite"
    cfg = GatewayConfig(admin_key="admin-" + secrets.token_hex(8), upstream_url=engine.url, pause_wait_s=0.2)
    store = SQLiteStore(store_path)
    with ThreadServer(create_app(cfg, store)) as srv:
        gw = GatewayHandle(srv.url, cfg.admin_key, store, engine.url)
        _, key = gw.new_rollout(sampling={"max_tokens": 2})
        with gw.admin() as c:
            c.post("/control/resume", json={"weight_version": 7}).raise_for_status()
            c.post("/control/pause", json={"drain_timeout_s": 5}).raise_for_status()
    store.close()

    store = SQLiteStore(store_path)  # the same store, a new gateway process's state
    with ThreadServer(create_app(cfg, store)) as srv:
        gw = GatewayHandle(srv.url, cfg.admin_key, store, engine.url)
        with gw.admin() as c:
            assert c.get("/control/status").json() == {"paused": True, "in_flight": 0, "weight_version": 7}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "paused"
        with gw.admin() as c:
            c.post("/control/resume", json={}).raise_for_status()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    store.close()

    store = SQLiteStore(store_path)  # resumed before it stopped: the next one starts admitting
    with (
        ThreadServer(create_app(cfg, store)) as srv,
        GatewayHandle(srv.url, cfg.admin_key, store, "").admin() as c,
    ):
        assert c.get("/control/status").json()["paused"] is False
    store.close()
