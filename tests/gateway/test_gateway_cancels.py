"""A cancel that lands in the loop turn the gateway's wait completes still cancels.

Python 3.11's `asyncio.wait_for` runs its awaitable in a task of its own; cancelled after that task has
finished but before the waiter resumes, it returns the result instead of raising, and the caller runs on
(db9d694 found it in the Kubernetes runner). Each test makes that turn happen on purpose: it completes
what the wait waits on (an event set, a connection opened, an answer's head received) and cancels the
waiter before the loop runs again. Every one of them failed with 'DID NOT RAISE' under `wait_for`.

Where the cancel comes from in a served gateway, and why most of these tests are units: a client that
hangs up during a non-streamed call cancels the handler's task (`Admission.run`, told by the gateway's
HTTP protocol), and a preempting pause does too; both reach the engine client's waits, tested here over
loopback against a real socket. A hang-up during the admission wait or a pause's drain cancels nothing
under the gateway's server (no hook is armed there yet); those waits are cancelled by a server shutdown.
An event stream's hang-up is delivered by anyio's cancel scope (Starlette's streaming response), which
cancels again at the next wait, so over HTTP the lost cancel cost one more loop and was not seen; the
wait itself is tested."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import pytest

from harnessrl.gateway.admission import Admission
from harnessrl.gateway.engine_client.httpclient import HTTPPool
from harnessrl.gateway.state import Gateway, GatewayConfig
from harnessrl.store import SQLiteStore


async def turns(n: int = 5) -> None:
    """Let the loop run `n` times (the waiter is waiting after two)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_call_cancelled_as_the_gateway_resumes_is_not_admitted() -> None:
    adm = Admission(pause_wait_s=30)
    adm.hold()
    admitted: list[int] = []

    async def call() -> None:
        async with adm.slot():
            admitted.append(adm.in_flight)

    task = asyncio.create_task(call())
    await turns()
    assert not task.done() and adm.in_flight == 0  # waiting for the resume
    adm.resume()
    task.cancel()  # same turn: the wait's event is set, then the cancel comes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admitted == [] and adm.in_flight == 0


async def test_a_pause_cancelled_as_its_last_call_ends_is_cancelled() -> None:
    adm = Admission(pause_wait_s=1)
    async with adm.slot() as slot:
        release = slot.hand_over()  # a streamed answer still running
    pausing = asyncio.create_task(adm.pause(drain_timeout_s=30))
    await turns()
    assert not pausing.done() and adm.in_flight == 1
    release()  # drained: the pause's event is set
    pausing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pausing
    assert adm.in_flight == 0


async def test_an_event_stream_wait_cancelled_as_a_state_changes_is_cancelled(tmp_path: Path) -> None:
    gw = Gateway(GatewayConfig(admin_key="admin-" + secrets.token_hex(8)), SQLiteStore(tmp_path / "s.sqlite"))
    waiting = asyncio.create_task(gw.wait_events(30))
    await turns()
    assert not waiting.done()
    await gw.notify_events()  # returns without yielding to the loop (the condition's lock is free)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not gw._event_seq.locked()  # the condition's lock went back with the cancel
    later = asyncio.create_task(gw.wait_events(30))  # and the next reader is woken as before
    await turns()
    await gw.notify_events()
    await asyncio.wait_for(later, 5)


class Engine:
    """A loopback HTTP server answering every POST with a small JSON body, one request per connection;
    it counts the connections and the ones closed by the client before their answer was read."""

    def __init__(self, head_only: bool = False) -> None:
        self.head_only = head_only  # answer the head and keep the body back (a streamed answer)
        self.connections = 0
        self.closed_early = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        if self.head_only:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        if await reader.read(1) == b"":  # the client closed the connection
            self.closed_early.set()
        writer.close()


async def test_an_engine_call_cancelled_as_its_connection_opens_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut of a client that hung up (or of a preempting pause) lands as the connection to the engine
    opens: the call stops there and closes the connection, rather than waiting for the whole answer."""
    engine = Engine()
    async with engine as url:
        pool = HTTPPool(url, timeout_s=30)
        loop = asyncio.get_running_loop()
        create_connection = loop.create_connection
        caller: list[asyncio.Task[Any]] = []

        async def open_then_cancel(*args: Any, **kwargs: Any) -> Any:
            opened = await create_connection(*args, **kwargs)
            caller[0].cancel()  # in the turn the connection is made
            return opened

        monkeypatch.setattr(loop, "create_connection", open_then_cancel)
        task = asyncio.create_task(pool.post("/v1/chat/completions", b"{}"))
        caller.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine.closed_early.wait(), 10)
        assert engine.connections == 1
        await pool.aclose()


async def test_a_stream_cancelled_as_its_answer_begins_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel lands as the engine's status line and headers arrive: `stream` raises it and closes the
    connection instead of handing back a stream that nobody reads."""
    from harnessrl.gateway.engine_client import httpclient

    engine = Engine(head_only=True)
    async with engine as url:
        pool = HTTPPool(url, timeout_s=30)
        caller: list[asyncio.Task[Any]] = []

        class CancelAtHead(httpclient._StreamResponse):
            def __init__(self) -> None:
                super().__init__()
                self.head.add_done_callback(lambda _: caller[0].cancel())

        monkeypatch.setattr(httpclient, "_StreamResponse", CancelAtHead)
        task = asyncio.create_task(pool.stream("/v1/chat/completions", b"{}"))
        caller.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(engine.closed_early.wait(), 10)
        await pool.aclose()
