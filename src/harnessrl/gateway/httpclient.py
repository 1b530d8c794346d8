"""A small HTTP/1.1 client for the gateway's hot path: keep-alive connections to one engine, JSON
POSTs, Content-Length or chunked answers. It exists because a general client's per-request overhead
was most of the gateway's CPU (measured with py-spy under load)."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


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
            lines = bytes(self.buf[:end]).split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                self.headers[k.strip().lower()] = v.strip()
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


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
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

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// upstreams are supported by the fast client, got {base_url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._host_header = f"{self.host}:{self.port}".encode()

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), timeout=self.connect_timeout_s
            )
        except (OSError, TimeoutError) as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return conn

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body; returns (status, body). Transport problems raise `HTTPError`."""
        conn = await self._connect()
        conn.response = _Response()
        head = (
            b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self._host_header
            + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )  # fmt: skip
        assert conn.transport is not None
        conn.transport.write(head + body)
        try:
            status, data = await asyncio.wait_for(asyncio.shield(conn.response.done), timeout=self.timeout_s)
        except TimeoutError as e:
            conn.transport.close()
            raise HTTPError(f"no answer from {self.host}:{self.port} within {self.timeout_s}s") from e
        except asyncio.CancelledError:
            conn.transport.close()
            raise
        keep = conn.response.keep_alive and not conn.closed
        conn.response = None
        if keep:
            self._idle.append(conn)
        else:
            conn.transport.close()
        return status, data

    async def aclose(self) -> None:
        """Close idle connections."""
        for conn in self._idle:
            if conn.transport is not None:
                with contextlib.suppress(Exception):
                    conn.transport.close()
        self._idle.clear()
