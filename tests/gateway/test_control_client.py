"""The control client over a connection that drops: a loopback proxy in front of a real gateway
forwards a request, lets the gateway carry it out, then closes the client's connection without the
answer (what a training run once hit right after a weight load: `httpx.ReadError` on
`start_attempt`, which stopped the whole run)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from harnessrl.gateway import client as control_client
from harnessrl.gateway.client import ControlClient, ControlUnreachable
from harnessrl.schema import AttemptFinish, AttemptStatus, RolloutCreate, RolloutState
from tests.support.gateway import GatewayHandle


class DroppingProxy:
    """HTTP/1.1 proxy on loopback, one request per connection. A request whose first line contains
    `match` is forwarded and answered by the gateway, but the first `times` of them get their
    connection closed instead of the answer."""

    def __init__(self, upstream: str, match: bytes, times: int, forward: bool = True) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.match, self.times = match, times
        self.forward = forward  # False: a dropped request never reaches the gateway
        self.seen = 0  # matching requests forwarded
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            writer.close()
            return
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        matched = self.match in head.split(b"\r\n", 1)[0]
        self.seen += matched
        drop = matched and self.seen <= self.times
        if drop and not self.forward:
            writer.close()
            return
        up_r, up_w = await asyncio.open_connection(self.host, self.port)
        up_w.write(head[:-2] + b"Connection: close\r\n\r\n" + body)
        await up_w.drain()
        answer = await up_r.read()  # the gateway closes after answering
        up_w.close()
        if not drop:
            writer.write(answer)
            await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _rollout(gw: GatewayHandle, client_id: str) -> str:
    direct = ControlClient(gw.url, gw.admin_key)
    rid = (await direct.create_rollout(RolloutCreate(client_id=client_id, task_id="t"))).rollout.rollout_id
    await direct.aclose()
    return rid


async def test_idempotent_requests_are_resent_after_a_dropped_answer(
    make_gateway: Callable[..., GatewayHandle], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = make_gateway()
    rid = await _rollout(gw, "resend")
    proxy = DroppingProxy(gw.url, b"/state", times=2)
    client = ControlClient(await proxy.start(), gw.admin_key)
    await client.start_attempt(rid)
    rollout = await client.set_state(rid, RolloutState.SUCCEEDED)  # two answers lost, the third arrives
    assert rollout.state == RolloutState.SUCCEEDED and proxy.seen == 3
    stored = gw.store.get_rollout(rid)
    assert stored is not None and stored.state == RolloutState.SUCCEEDED

    # a gateway that never answers: a clear error (an OSError, so the controller fails the rollout
    # it was on and the run goes on) after RETRIES resends, not an httpx exception
    monkeypatch.setattr(control_client, "RETRIES", 1)
    proxy.times, proxy.seen = 10**6, 0
    with pytest.raises(ControlUnreachable, match="/state") as err:
        await client.set_state(rid, RolloutState.SUCCEEDED)
    assert isinstance(err.value, OSError) and proxy.seen == 2
    await client.aclose()
    await proxy.close()


async def test_start_attempt_is_not_opened_twice_when_its_answer_is_lost(
    make_gateway: Callable[..., GatewayHandle],
) -> None:
    gw = make_gateway()
    rid = await _rollout(gw, "adopt")
    proxy = DroppingProxy(gw.url, b"/attempts", times=1)
    client = ControlClient(await proxy.start(), gw.admin_key)
    attempt = await client.start_attempt(rid)  # carried out, answer lost: the running attempt is adopted
    assert attempt.attempt == 0 and attempt.status == AttemptStatus.RUNNING and proxy.seen == 1
    assert [a.attempt for a in gw.store.attempts(rid)] == [0]
    # attempt 0 ends; a request lost before it reached the gateway is sent again (the ended attempt
    # is not taken for the one asked for), and only one new attempt opens
    direct = ControlClient(gw.url, gw.admin_key)
    await direct.finish_attempt(rid, 0, AttemptFinish(status=AttemptStatus.INFRA_ERROR, error="test"))
    await direct.set_state(rid, RolloutState.QUEUED)
    proxy.seen, proxy.forward = 0, False
    attempt = await client.start_attempt(rid)
    assert attempt.attempt == 1 and attempt.status == AttemptStatus.RUNNING and proxy.seen == 2
    assert [a.attempt for a in gw.store.attempts(rid)] == [0, 1]
    await direct.aclose()
    await client.aclose()
    await proxy.close()
