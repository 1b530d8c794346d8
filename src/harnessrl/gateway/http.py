"""Small HTTP helpers shared by the gateway's faces: key extraction, bounded JSON bodies, guards.

The JSON policy at the door (`read_json`), one for every route, so that nothing the gateway accepts
is later unstorable or unreadable and no body can hold the event loop for long:
- size: at most `max_body_bytes` (8 MiB by default), enforced while the body streams in (a chunked
  body is cut at the limit, not read whole): 413;
- time: the whole body within `BODY_TIMEOUT_S` of the headers: 408;
- nesting: at most `MAX_JSON_DEPTH` levels of objects/arrays: 400 (the store's reader takes ~200);
- bulk: at most `MAX_JSON_CONTAINERS` objects/arrays and `MAX_JSON_VALUES` values: 413 (a 100k-message
  request costs the gateway seconds of CPU to validate; no model context holds that many turns).
Large bodies are checked on a worker thread, so other rollouts keep being served meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from harnessrl.gateway.admission import DISCONNECT_HOOK, DisconnectHook
from harnessrl.gateway.errors import APIError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class RouteSpec:
    """One route of the gateway and what its OpenAPI entry says (the document is generated from these)."""

    path: str
    method: str
    handler: Handler
    summary: str
    body: type[BaseModel] | None = None  # the JSON body the handler validates
    security: Literal["rolloutKey", "adminKey"] | None = "rolloutKey"  # None: open (health, the document)
    query: tuple[dict[str, Any], ...] = ()  # OpenAPI query parameters
    error_style: Literal["openai", "anthropic"] = "openai"  # the error body's shape
    counted: bool = False  # error answers counted in the metrics (model calls)
    logged: bool = True  # error answers logged with their reason
    streams: bool = False  # answers with a server-sent event stream that stays open


MAX_JSON_DEPTH = 64
MAX_JSON_CONTAINERS = 20_000
MAX_JSON_VALUES = 250_000
BODY_TIMEOUT_S = 60.0
OFF_LOOP_BYTES = 256 * 1024  # bodies above this are checked on a worker thread
HEADER_TIMEOUT_S = 15.0
MAX_HEADER_BYTES = 64 * 1024
HEADERS_TOO_LARGE = f"request line and headers over {MAX_HEADER_BYTES} bytes"


def bearer(request: Request) -> str | None:
    """The API key from `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


async def read_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The request body, read as it streams in: 413 as soon as it passes `max_bytes`, 408 when it
    takes longer than `timeout_s` (default `BODY_TIMEOUT_S`)."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(
                        413, f"request body is over {max_bytes} bytes (the limit); it was cut there"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408, f"request body not received within {timeout_s:g} s", code="body_timeout"
        ) from None
    except ClientDisconnect:
        raise APIError(
            400, "the client disconnected before sending the whole body", code="client_gone"
        ) from None
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int, empty: Any = None) -> Any:
    """The body parsed as JSON under the door policy (module docstring): 413 when oversized, 408 when
    too slow, 400 when malformed or nested too deep; `empty` for an empty body."""
    raw = await read_body(request, max_bytes)
    if empty is not None and not raw.strip():
        return empty
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """Parse `raw` and check it against the nesting and bulk limits; `APIError` names the problem."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    opened = raw.count(b"{") + raw.count(b"[")
    if opened <= MAX_JSON_DEPTH and raw.count(b",") + opened < MAX_JSON_VALUES:
        return value  # fewer brackets than the depth limit, fewer values than the bulk limit
    problem = json_shape_problem(value)
    if problem is not None:
        status, message = problem
        raise APIError(status, f"request body {message}", code="json_limits")
    return value


def json_shape_problem(
    value: Any,
    max_depth: int = MAX_JSON_DEPTH,
    max_containers: int = MAX_JSON_CONTAINERS,
    max_values: int = MAX_JSON_VALUES,
) -> tuple[int, str] | None:
    """(status, what is wrong) when `value` nests deeper than `max_depth` or holds more objects/arrays
    or values than allowed; None when it is within the limits. Stops at the first excess, so its cost
    is bounded by the limits, not by the body."""
    containers = values = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return 400, f"nests objects/arrays deeper than {max_depth} levels (the gateway's limit)"
        items = node.values() if isinstance(node, dict) else node
        containers += 1
        values += len(items)
        if values > max_values:
            return 413, f"holds more than {max_values} JSON values (the gateway's limit)"
        room = max_containers - containers - len(stack)  # objects/arrays still allowed
        for item in items:
            if isinstance(item, dict | list):
                if room <= 0:
                    return 413, f"holds more than {max_containers} objects/arrays (the gateway's limit)"
                room -= 1
                stack.append((item, depth + 1))
    return None


class FastJSONResponse(Response):
    """A JSON response rendered with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Serialise `content`."""
        return orjson.dumps(content)


def guarded(
    handler: Handler, style: str = "openai", on_error: Callable[[int], None] | None = None
) -> Handler:
    """Turn `APIError` into its response (in the face's error `style`) and anything else into a logged
    500; `on_error` sees every error status."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            if on_error is not None:
                on_error(e.status)
            return e.response(style)
        except Exception:
            log.exception("event=unhandled_error path=%s", request.url.path)
            if on_error is not None:
                on_error(500)
            return APIError(500, "internal error in the gateway; see its log").response(style)

    return run


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) with the limits it lacks for slow or idle clients: a
    request's line and headers must arrive within `header_timeout_s` (counted from the connection, or
    from the first byte of a later request) and fit in `MAX_HEADER_BYTES`; otherwise the connection is
    closed (431 for oversized headers). Idle keep-alive connections are closed by uvicorn's own
    `timeout_keep_alive`, slow bodies by `read_body`'s timeout."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the clock for the first request's headers."""
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._serving: RequestResponseCycle | None = None
        self._parsed_head = 0  # bytes of the current request's line and headers, as parsed
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Parse, then refuse a request whose headers are still incomplete past `MAX_HEADER_BYTES`
        (the parser buffers a header until it ends, so it is counted here by the chunk)."""
        pending = self._header_timer is not None
        super().data_received(data)
        if not pending or self._header_timer is None:
            return  # no headers were pending, or they are complete now
        self._header_bytes += len(data)
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._disarm()
            self.send_400_response(HEADERS_TOO_LARGE)

    def on_url(self, url: bytes) -> None:
        """Count the request target against `MAX_HEADER_BYTES`."""
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count each header against `MAX_HEADER_BYTES`."""
        super().on_header(name, value)
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        self._parsed_head += n
        if self._parsed_head > MAX_HEADER_BYTES:
            raise ValueError(HEADERS_TOO_LARGE)  # the parser stops; uvicorn answers via send_400_response

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to an unparsable request; a 431 when the headers were too large."""
        if self.transport.is_closing():
            return
        if self._parsed_head <= MAX_HEADER_BYTES and msg != HEADERS_TOO_LARGE:
            super().send_400_response(msg)
            return
        log.warning("event=request_headers_too_large client=%s", self.client)
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                             b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(HEADERS_TOO_LARGE), HEADERS_TOO_LARGE.encode()))  # fmt: skip
        self.transport.close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """Remember the cycle being served (with pipelined requests it is not `self.cycle`) and give
        its scope a `DisconnectHook` (what `Admission.run` cuts a call by when the client hangs up)."""
        self._serving = cycle
        cycle.scope.setdefault("extensions", {})[DISCONNECT_HOOK] = DisconnectHook()  # type: ignore[typeddict-unknown-key,assignment]
        super()._start_asgi_task(cycle, app)

    def on_message_begin(self) -> None:
        """A new request begins: its headers are on the clock."""
        super().on_message_begin()
        self._parsed_head = 0
        if self._header_timer is None:
            self._header_bytes = 0
            self._arm()

    def on_headers_complete(self) -> None:
        """The headers are in: stop their clock."""
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drop the clock with the connection; tell the request being served (uvicorn tells only the
        last one parsed, so a pipelined request's handler would write to a closed transport)."""
        self._disarm()
        serving = self._serving
        if serving is not None and serving is not self.cycle and not serving.response_complete:
            serving.disconnected = True
            serving.message_event.set()
        super().connection_lost(exc)
        if serving is not None and not serving.response_complete:
            hook = serving.scope.get("extensions", {}).get(DISCONNECT_HOOK)
            if isinstance(hook, DisconnectHook):
                hook.fire()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("event=request_headers_timeout client=%s", self.client)
            self.transport.close()
