"""The control API's push stream of state changes and the Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from openai import OpenAI

from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RolloutCreate, RolloutState
from tests.support.gateway import GatewayHandle


async def test_state_changes_are_pushed_and_replayable(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    client = ControlClient(gw.url, gw.admin_key)
    seen: list[tuple[str, str, int]] = []

    async def listen(after: int, n: int) -> None:
        async for ev in client.events(after=after):
            seen.append((ev.rollout_id, ev.state.value, ev.seq))
            if len(seen) >= n:
                return

    listener = asyncio.create_task(listen(0, 5))
    await asyncio.sleep(0.2)  # the stream is open before anything happens
    a = (
        await client.create_rollout(RolloutCreate(client_id="a", task_id="t", group_id="g"))
    ).rollout.rollout_id
    b = (await client.create_rollout(RolloutCreate(client_id="b", task_id="t"))).rollout.rollout_id
    await client.create_rollout(RolloutCreate(client_id="a", task_id="t"))  # idempotent: no new event
    await client.start_attempt(a)
    await client.set_state(a, RolloutState.SUCCEEDED)
    await client.set_state(b, RolloutState.CANCELLED)
    await asyncio.wait_for(listener, timeout=20)
    assert [(r, s) for r, s, _ in seen] == [
        (a, "queued"),
        (b, "queued"),
        (a, "running"),
        (a, "succeeded"),
        (b, "cancelled"),
    ]
    assert [q for _, _, q in seen] == sorted(q for _, _, q in seen)
    # a reader that reconnects after the third event gets only what followed
    seen.clear()
    await asyncio.wait_for(listen(3, 2), timeout=20)  # events 1-3: two queued, one running
    assert [(r, s) for r, s, _ in seen] == [(a, "succeeded"), (b, "cancelled")]
    r = httpx.get(
        f"{gw.url}/control/events", params={"after": "x"}, headers={"Authorization": f"Bearer {gw.admin_key}"}
    )
    assert r.status_code == 400
    await client.aclose()


def test_metrics_count_calls_tokens_and_errors(make_gateway: Callable[..., GatewayHandle]) -> None:
    gw = make_gateway()
    rid, key = gw.new_rollout()
    sdk = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    httpx.post(f"{gw.url}/v1/chat/completions", content=b"{", headers={"Authorization": f"Bearer {key}"})
    text = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {gw.admin_key}"}).text
    (call,) = gw.store.calls(rid)
    assert 'harnessrl_gateway_calls_total{face="openai.chat",status="ok"} 1' in text
    assert f"harnessrl_gateway_completion_tokens_total {len(call.completion_ids)}" in text
    assert 'harnessrl_gateway_errors_total{status="400"} 1' in text
    assert 'harnessrl_gateway_call_latency_seconds_count{face="openai.chat"} 1' in text
    assert "harnessrl_gateway_paused 0" in text and "harnessrl_gateway_in_flight 0" in text


async def test_replicas_on_one_postgres_store_push_each_others_state_changes(engine, pg_url: str) -> None:  # type: ignore[no-untyped-def]
    """Two gateways on one PostgreSQL database: a reader of A's event stream sees what B stored at
    once (LISTEN/NOTIFY), not at A's next keep-alive."""
    import secrets

    from harnessrl.gateway.app import GatewayConfig, create_app
    from harnessrl.store import open_store
    from tests.support.gateway import ThreadServer

    admin = "admin-" + secrets.token_hex(8)
    stores = [open_store(pg_url), open_store(pg_url)]
    cfg = GatewayConfig(admin_key=admin, upstream_url=engine.url)
    with ThreadServer(create_app(cfg, stores[0])) as a, ThreadServer(create_app(cfg, stores[1])) as b:
        reader, writer = ControlClient(a.url, admin), ControlClient(b.url, admin)
        seen: list[tuple[str, float]] = []

        async def listen() -> None:
            async for ev in reader.events(after=0):
                seen.append((ev.rollout_id, asyncio.get_running_loop().time()))
                return

        listener = asyncio.create_task(listen())
        await asyncio.sleep(0.5)  # the stream is open and waiting before B writes
        t0 = asyncio.get_running_loop().time()
        created = await writer.create_rollout(RolloutCreate(client_id="x", task_id="t"))
        await asyncio.wait_for(listener, timeout=10)
        assert seen[0][0] == created.rollout.rollout_id
        assert seen[0][1] - t0 < 5  # well before the 15 s keep-alive of a stream that only polls on wake
        await reader.aclose()
        await writer.aclose()
    for s in stores:
        s.close()
