"""The builtin engine's key: with one, every route but /health answers 401 to a request without it,
so a harness that finds the engine's port cannot generate, pause or load weights; the gateway and the
trainer's admin client send it."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harnessrl.gateway.app import create_app
from harnessrl.gateway.state import GatewayConfig
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.weight_stream import MEDIA_TYPE, sync_state
from harnessrl.services import Service, free_port, start_engine
from harnessrl.store import SQLiteStore
from harnessrl.trainer.weights import engine_admin
from tests.support.gateway import GatewayHandle, ThreadServer

KEY = "engine-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_engine(
        tiny_model_dir, free_port(), tmp_path_factory.mktemp("keyed-engine"), 4, 512, 1, api_key=KEY
    )
    try:
        svc.wait_healthy(120)
        yield svc
    finally:
        svc.stop()


def test_every_route_but_health_needs_the_key(keyed_engine: Service) -> None:
    url = keyed_engine.url
    assert httpx.get(f"{url}/health").status_code == 200
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert "engine key" in r.json()["error"]["message"]
    for method, path in [("POST", "/admin/load_weights"), ("POST", "/admin/pause"), ("GET", "/admin/stats"),
                         ("GET", "/v1/models"), ("POST", "/tokenize")]:  # fmt: skip
        assert httpx.request(method, f"{url}{path}", json={}).status_code == 401, path
    weights = {"Content-Type": MEDIA_TYPE}  # the trainer's memory sync: refused before the body is read
    assert httpx.post(f"{url}/admin/load_weights?version=1", content=b"x", headers=weights).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_the_gateway_and_the_admin_client_send_the_key(
    keyed_engine: Service, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    cfg = GatewayConfig(
        admin_key="admin-" + secrets.token_hex(8), upstream_url=keyed_engine.url, upstream_key=KEY
    )
    with ThreadServer(create_app(cfg, store)) as srv:
        gw = GatewayHandle(srv.url, cfg.admin_key, store, keyed_engine.url)
        rid, key = gw.new_rollout(sampling={"max_tokens": 3})
        r = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert store.calls(rid)[0].completion_ids
    without = GatewayConfig(admin_key=cfg.admin_key, upstream_url=keyed_engine.url)
    with ThreadServer(create_app(without, SQLiteStore(tmp_path / "t.sqlite"))) as srv:
        _, key = GatewayHandle(srv.url, cfg.admin_key, store, keyed_engine.url).new_rollout()
        r = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)  # fmt: skip
        assert r.status_code == 502, r.text  # the engine refused the gateway that has no key
        assert "HARNESSRL_ENGINE_KEY" in r.json()["error"]["message"]

    async def versions() -> tuple[int, str]:
        admin = engine_admin("builtin", keyed_engine.url, api_key=KEY)
        keyless = engine_admin("builtin", keyed_engine.url)
        try:
            v = await admin.weight_version()
            assert await admin.push_weights(sync_state(load_model(tiny_model_dir)), v) == v  # same weights
            try:
                await keyless.weight_version()
            except Exception as e:
                return v, str(e)
            return v, ""
        finally:
            await admin.aclose()
            await keyless.aclose()

    version, refused = asyncio.run(versions())
    assert version == 0 and "401" in refused


def test_a_refused_engine_key_is_the_operators_error_not_the_callers(
    keyed_engine: Service, tmp_path: Path
) -> None:
    """An engine's 401 to the gateway's key (a gateway started with another $HARNESSRL_ENGINE_KEY than the
    engine's) reaches the harness as a 502 naming the variable, on every face, streamed or not, and the
    call is recorded as failed; the wrong key appears nowhere in what the harness gets."""
    wrong = "wrong-" + secrets.token_hex(8)
    store = SQLiteStore(tmp_path / "s.sqlite")
    cfg = GatewayConfig(admin_key="admin-" + secrets.token_hex(8), upstream_url=keyed_engine.url,
                        upstream_key=wrong)  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}]
    with ThreadServer(create_app(cfg, store)) as srv:
        rid, key = GatewayHandle(srv.url, cfg.admin_key, store, keyed_engine.url).new_rollout()
        auth = {"Authorization": f"Bearer {key}", "x-api-key": key}
        for path, body in [
            ("/v1/chat/completions", {"model": "gpt-4o", "messages": msgs}),
            ("/v1/chat/completions", {"model": "gpt-4o", "messages": msgs, "stream": True}),
            ("/v1/messages", {"model": "claude", "max_tokens": 4, "messages": msgs, "stream": True}),
            ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
        ]:
            r = httpx.post(f"{srv.url}{path}", headers=auth, json=body, timeout=60)
            assert r.status_code == 502, (path, body, r.text)
            said = r.text
            assert "refused the gateway's engine key" in said and "HARNESSRL_ENGINE_KEY" in said, said
            assert wrong not in said and wrong[6:] not in said
        calls = store.calls(rid)
        assert len(calls) == 4 and all("HARNESSRL_ENGINE_KEY" in (c.error or "") for c in calls)


def test_count_tokens_names_the_engine_key_the_engine_refuses(keyed_engine: Service, tmp_path: Path) -> None:
    """`/v1/messages/count_tokens` asks the engine's `/tokenize` (passthrough mode): a refused engine key
    reaches the harness as the model calls' 502 does, naming the variable and not the key (it said only
    'could not count the prompt's tokens' before); with the right key it counts."""
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    for upstream_key, wrong in [("wrong-" + secrets.token_hex(8), True), (KEY, False)]:
        store = SQLiteStore(tmp_path / f"s-{wrong}.sqlite")
        cfg = GatewayConfig(admin_key="admin-" + secrets.token_hex(8), upstream_url=keyed_engine.url,
                            upstream_key=upstream_key)  # fmt: skip
        with ThreadServer(create_app(cfg, store)) as srv:
            _, key = GatewayHandle(srv.url, cfg.admin_key, store, keyed_engine.url).new_rollout()
            headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
            r = httpx.post(f"{srv.url}/v1/messages/count_tokens", headers=headers, json=body, timeout=60)
        if not wrong:
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
            continue
        assert r.status_code == 502, r.text
        said = r.json()["error"]["message"]
        assert said.startswith("the engine could not count the prompt's tokens: upstream engine0 refused the "
                               "gateway's engine key (401)"), said  # fmt: skip
        assert (
            "HARNESSRL_ENGINE_KEY" in said and upstream_key not in r.text and upstream_key[6:] not in r.text
        )
