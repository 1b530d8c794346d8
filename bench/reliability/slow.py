"""Socket-level cases of the corpus: slow or idle clients, and clients that go away mid-request or
mid-stream. Each returns its outcome: the status the gateway answered, "closed" when it closed the
connection without one, "open" when it was still holding a connection it should have dropped, or
"client_closed" when the client left first (then the gateway's log and store tell the rest)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Awaitable, Callable

from bench.reliability.client import Gateway
from bench.reliability.corpus import CHAT, Case

WAIT_S = 12.0  # longer than the header and body timeouts the suite runs the gateway with


async def _connect(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", gw.proc.port)


async def _outcome(reader: asyncio.StreamReader, wait_s: float = WAIT_S) -> str:
    try:
        data = await asyncio.wait_for(reader.read(65536), wait_s)
    except TimeoutError:
        return "open"
    except ConnectionError:
        return "closed"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"


def _head(key: str, length: int | None, path: str = CHAT) -> bytes:
    framing = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n").encode()  # fmt: skip


def _body(content: str = "hi", stream: bool = False) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    ).encode()


async def idle(gw: Gateway, key: str) -> str:
    """Connects and sends nothing."""
    reader, writer = await _connect(gw)
    try:
        return await _outcome(reader)
    finally:
        writer.close()


async def dribble_headers(gw: Gateway, key: str) -> str:
    """Sends its request line a byte every 0.5 s."""
    reader, writer = await _connect(gw)
    try:
        for b in b"POST /v1/chat/completions HTTP/1.1\r\n":
            writer.write(bytes([b]))
            try:
                await writer.drain()
            except ConnectionError:
                return "closed"
            if reader.at_eof():
                return "closed"
            await asyncio.sleep(0.5)
        return await _outcome(reader, 1.0)
    finally:
        writer.close()


async def slow_body(gw: Gateway, key: str) -> str:
    """Declares 1000 bytes of body and sends 10."""
    reader, writer = await _connect(gw)
    try:
        writer.write(_head(key, 1000) + b'{"model":"')
        return await _outcome(reader)
    finally:
        writer.close()


async def short_body_half_close(gw: Gateway, key: str) -> str:
    """Declares 1000 bytes, sends 10, then closes its side of the connection."""
    reader, writer = await _connect(gw)
    try:
        writer.write(_head(key, 1000) + b'{"model":"')
        await writer.drain()
        writer.write_eof()
        return await _outcome(reader)
    finally:
        writer.close()


def _huge(kind: str) -> Callable[[Gateway, str], Awaitable[str]]:
    async def send(gw: Gateway, key: str) -> str:
        reader, writer = await _connect(gw)
        try:
            if kind == "header":
                head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"
            elif kind == "many_headers":
                head = (
                    b"GET /health HTTP/1.1\r\nHost: x\r\n"
                    + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(1000))
                    + b"\r\n"
                )
            else:
                head = b"GET /health?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            writer.write(head)
            try:
                await writer.drain()
            except ConnectionError:
                return "closed"
            return await _outcome(reader)
        finally:
            writer.close()

    return send


async def many_idle(gw: Gateway, key: str) -> str:
    """Twenty idle connections at once: all must be dropped."""
    outcomes = await asyncio.gather(*[idle(gw, key) for _ in range(20)])
    return "closed" if all(o == "closed" for o in outcomes) else "open"


def _disconnect(stage: str) -> Callable[[Gateway, str], Awaitable[str]]:
    async def leave(gw: Gateway, key: str) -> str:
        reader, writer = await _connect(gw)
        stream = stage.startswith("stream")
        body = _body("fault:slow" if stream else "hi", stream)
        if stage == "after_headers":
            writer.write(_head(key, len(body)))
        elif stage == "mid_body":
            writer.write(_head(key, len(body)) + body[: len(body) // 2])
        else:
            writer.write(_head(key, len(body)) + body)
        await writer.drain()
        if stream:
            events = 0
            while events < (1 if stage == "stream_first" else 20):
                line = await asyncio.wait_for(reader.readline(), 30)
                events += line.startswith(b"data:")
        if stage == "stream_reset":  # an abortive close (RST) instead of FIN
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        return "client_closed"

    return leave


async def pipelined_then_gone(gw: Gateway, key: str) -> str:
    """Two requests in one write, then the client leaves before any answer."""
    _, writer = await _connect(gw)
    body = _body()
    writer.write((_head(key, len(body)) + body) * 2)
    await writer.drain()
    writer.close()
    return "client_closed"


def slow_and_disconnect_cases() -> list[Case]:
    """The socket-level cases."""
    slow = {"idle": idle, "dribble_headers": dribble_headers, "slow_body": slow_body,
            "short_body_half_close": short_body_half_close, "huge_header": _huge("header"),
            "many_headers": _huge("many_headers"), "huge_url": _huge("url"), "many_idle": many_idle}  # fmt: skip
    gone = {f"disconnect_{s}": _disconnect(s) for s in
            ("after_headers", "mid_body", "before_answer", "stream_first", "stream_later", "stream_reset")}  # fmt: skip
    gone["pipelined_then_gone"] = pipelined_then_gone
    return [Case("slow_clients", n, raw=f) for n, f in slow.items()] + [
        Case("disconnects", n, raw=f) for n, f in gone.items()
    ]
