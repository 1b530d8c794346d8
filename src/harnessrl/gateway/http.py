"""Small HTTP helpers shared by the gateway's faces: key extraction, bounded JSON bodies, guards."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from harnessrl.gateway.errors import APIError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def bearer(request: Request) -> str | None:
    """The API key from `Authorization: Bearer` (OpenAI) or `x-api-key` (Anthropic)."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


async def read_json(request: Request, max_bytes: int, empty: Any = None) -> Any:
    """The body parsed as JSON: 413 when oversized, 400 when malformed; `empty` for an empty body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {max_bytes}")
    if empty is not None and not raw.strip():
        return empty
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


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
            log.exception("unhandled_error path=%s", request.url.path)
            if on_error is not None:
                on_error(500)
            return APIError(500, "internal error in the gateway; see its log").response(style)

    return run
