"""A small HTTP/1.1 client for the gateway's hot path: keep-alive connections to one engine, JSON
POSTs, Content-Length or chunked answers. It exists because a general client's per-request overhead
was most of the gateway's CPU (measured with py-spy under load)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

# Below uvicorn's default keep-alive timeout (5 s; vLLM and SGLang servers use it): a connection is
# never reused at the moment the server closes it for idleness.
IDLE_EXPIRY_S = 4.0


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    """Status code and lower-cased headers of an HTTP/1.1 response head (without the blank line)."""
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split(b" ", 2)[1]), headers


def _bounded(wait_s: float, deadline: float | None) -> float:
    """`wait_s`, cut short so as not to pass `deadline` (a `time.monotonic()` instant; None: none)."""
    if deadline is None:
        return wait_s
    return max(0.0, min(wait_s, deadline - time.monotonic()))


class HTTPError(Exception):
    """The connection failed or the answer could not be read (a transport error: retryable)."""


class _Response:
    """Incremental parser of one HTTP/1.1 response."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body_start = -1
        self.done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self.keep_alive = True

    def feed(self, data: bytes) -> None:
        self.buf += data
        if self.body_start < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status, self.headers = _parse_head(bytes(self.buf[:end]))
            self.body_start = end + 4
            self.keep_alive = self.headers.get(b"connection", b"").lower() != b"close"
        self._try_finish()

    def _try_finish(self) -> None:
        body = memoryview(self.buf)[self.body_start :]
        if b"content-length" in self.headers:
            n = int(self.headers[b"content-length"])
            if len(body) >= n and not self.done.done():
                self.done.set_result((self.status, bytes(body[:n])))
        elif self.headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            decoded = _dechunk(bytes(body))
            if decoded is not None and not self.done.done():
                self.done.set_result((self.status, decoded))

    def eof(self) -> None:
        if not self.done.done():
            if (
                self.body_start >= 0
                and b"content-length" not in self.headers
                and b"transfer-encoding" not in self.headers
            ):
                self.done.set_result((self.status, bytes(self.buf[self.body_start :])))
            else:
                self.done.set_exception(HTTPError("connection closed before the answer was complete"))


def _dechunk(data: bytes) -> bytes | None:
    """The body of a complete chunked encoding, or None while incomplete."""
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out) if data.find(b"\r\n", end + 2) >= 0 else None
        if len(data) < end + 2 + size + 2:
            return None
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


class _StreamResponse:
    """Parser of one streamed response: the status and headers first, then body pieces in a queue."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.head: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pieces: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.chunked = False
        self.remaining = -1  # bytes left when Content-Length is known
        self.finished = False

    def feed(self, data: bytes) -> None:
        self.buf += data
        if not self.head.done():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self.status, self.headers = _parse_head(bytes(self.buf[:end]))
            del self.buf[: end + 4]
            self.chunked = self.headers.get(b"transfer-encoding", b"").lower() == b"chunked"
            if b"content-length" in self.headers:
                self.remaining = int(self.headers[b"content-length"])
            self.head.set_result(self.status)
        self._drain()

    def _drain(self) -> None:
        if self.finished:
            return
        if not self.chunked:
            if self.buf:
                take = len(self.buf) if self.remaining < 0 else min(len(self.buf), self.remaining)
                self.pieces.put_nowait(bytes(self.buf[:take]))
                del self.buf[:take]
                if self.remaining >= 0:
                    self.remaining -= take
            if self.remaining == 0:
                self._end()
            return
        while True:
            end = self.buf.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(self.buf[:end]).split(b";")[0], 16)
            if size == 0:
                self._end()
                return
            if len(self.buf) < end + 2 + size + 2:
                return
            self.pieces.put_nowait(bytes(self.buf[end + 2 : end + 2 + size]))
            del self.buf[: end + 2 + size + 2]

    def _end(self) -> None:
        self.finished = True
        self.pieces.put_nowait(None)

    def eof(self) -> None:
        if not self.head.done():
            self.head.set_exception(HTTPError("connection closed before the answer began"))
        elif not self.finished:
            if self.remaining < 0 and not self.chunked:
                self._end()
            else:
                self.finished = True
                self.pieces.put_nowait(HTTPError("connection closed in the middle of the answer"))


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | _StreamResponse | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            self.response.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.eof()


class HTTPPool:
    """Keep-alive connections to one `http://host:port` base URL."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// upstreams are supported by the fast client, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[tuple[_Connection, float]] = []  # with the time each went idle
        # the Host header's value, and the engine key (sent with every request) after it
        self._host_header = f"{self.host}:{self.port}".encode()
        if api_key:
            self._host_header += b"\r\nAuthorization: Bearer " + api_key.encode()

    async def _connect(self) -> _Connection:
        while self._idle:
            conn, since = self._idle.pop()
            if not conn.closed and time.monotonic() - since < IDLE_EXPIRY_S:
                return conn
            if conn.transport is not None:
                conn.transport.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except (OSError, TimeoutError) as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return conn

    async def post(self, path: str, body: bytes, timeout_s: float | None = None) -> tuple[int, bytes]:
        """POST a JSON body; returns (status, body). Transport problems, and no whole answer within
        `timeout_s` (default: the pool's), raise `HTTPError`."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        conn = await self._connect()
        conn.response = _Response()
        head = (
            b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self._host_header
            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        assert conn.transport is not None
        conn.transport.write(head + body)
        try:
            async with asyncio.timeout(wait_s):
                status, data = await conn.response.done
        except TimeoutError as e:
            conn.response.done.cancel()  # nobody waits for it any more: closing must not fail it
            conn.transport.close()
            raise HTTPError(f"no answer from {self.host}:{self.port} within {wait_s:.3g}s") from e
        except asyncio.CancelledError:  # e.g. a call cut by a preempting pause
            conn.response.done.cancel()
            conn.transport.close()
            raise
        keep = conn.response.keep_alive and not conn.closed
        conn.response = None
        if keep:
            self._idle.append((conn, time.monotonic()))
        else:
            conn.transport.close()
        return status, data

    async def stream(
        self, path: str, body: bytes, open_timeout_s: float | None = None, deadline: float | None = None
    ) -> tuple[int, AsyncIterator[bytes]]:
        """POST a JSON body and return (status, the body's pieces as they arrive). No status line and
        headers within `open_timeout_s` (default: the pool's timeout), a piece that takes longer than
        the pool's timeout, or passing `deadline` (a `time.monotonic()` instant) raise `HTTPError`."""
        wait_s = _bounded(self.timeout_s if open_timeout_s is None else open_timeout_s, deadline)
        conn = await self._connect()
        parser = _StreamResponse()
        conn.response = parser
        head = (
            b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self._host_header
            + b"\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        assert conn.transport is not None
        conn.transport.write(head + body)
        try:
            async with asyncio.timeout(wait_s):
                status = await parser.head
        except TimeoutError as e:
            parser.head.cancel()
            conn.transport.close()
            raise HTTPError(f"no answer headers from {self.host}:{self.port} within {wait_s:.3g}s") from e
        except asyncio.CancelledError:
            parser.head.cancel()
            conn.transport.close()
            raise
        return status, self._pieces(conn, parser, deadline)

    async def _pieces(
        self, conn: _Connection, parser: _StreamResponse, deadline: float | None
    ) -> AsyncIterator[bytes]:
        clean = False
        try:
            while True:
                wait_s = _bounded(self.timeout_s, deadline)
                if wait_s <= 0:  # past the deadline: a piece already queued would not time out below
                    raise TimeoutError
                async with asyncio.timeout(wait_s):
                    piece = await parser.pieces.get()
                if piece is None:
                    clean = True
                    return
                if isinstance(piece, BaseException):
                    raise piece
                yield piece
        except TimeoutError as e:
            raise HTTPError(
                f"the answer from {self.host}:{self.port} stalled or ran past its time limit"
            ) from e
        finally:
            conn.response = None
            keep = clean and not conn.closed and parser.headers.get(b"connection", b"").lower() != b"close"
            if keep:
                self._idle.append((conn, time.monotonic()))
            elif conn.transport is not None:
                conn.transport.close()

    async def aclose(self) -> None:
        """Close idle connections."""
        for conn, _ in self._idle:
            if conn.transport is not None:
                with contextlib.suppress(Exception):
                    conn.transport.close()
        self._idle.clear()
