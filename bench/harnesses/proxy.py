"""A transparent recording proxy in front of the gateway: every exchange a harness has with its model
API is forwarded unchanged (body, headers, streamed answer byte for byte; a client hanging up hangs up on
the gateway too, streamed or not) and logged as one JSON line:
method, path, status, whether the request asked to stream, and for an error its message. The suite
reads these logs to report each harness's HTTP outcome (a 400 and its message is never recorded as a
call by the gateway, so the store alone cannot tell it). Each line names the API key that sent it by a
hash (`key_hash`, see `key_hash()`), never the key itself, so one proxy serves many rollouts.

    python bench/harnesses/proxy.py --port 8201 --upstream http://127.0.0.1:8000 --log exchanges.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "upgrade"}
ERROR_BYTES = 2000
DISCONNECT_POLL_S = 0.25


def key_hash(key: str) -> str:
    """The short hash by which the log names an API key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _request_key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "")


def _summary(body: bytes) -> dict[str, Any]:
    """What the log keeps of a request body: model, stream flag, size."""
    try:
        data = json.loads(body) if body else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"bytes": len(body), "json": False}
    if not isinstance(data, dict):
        return {"bytes": len(body)}
    return {"bytes": len(body), "model": data.get("model"), "stream": bool(data.get("stream"))}


def _error_message(raw: bytes) -> str:
    """The error message of an error body (OpenAI or Anthropic shape), else its text."""
    try:
        err = json.loads(raw).get("error")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return raw[:ERROR_BYTES].decode(errors="replace")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])[:ERROR_BYTES]
    return str(err)[:ERROR_BYTES]


def build_app(upstream: str, log_path: Path) -> Starlette:
    """The proxy app: any method on any path goes to `upstream`."""
    state: dict[str, httpx.AsyncClient] = {}

    def write(entry: dict[str, Any]) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        url = httpx.URL(upstream + request.url.path, query=request.url.query.encode())
        entry: dict[str, Any] = {"t": time.time(), "key_hash": key_hash(_request_key(request)),
                                 "method": request.method, "path": request.url.path, **_summary(body)}  # fmt: skip
        client = state["client"]
        req = client.build_request(request.method, url, headers=headers, content=body)
        sending = asyncio.ensure_future(client.send(req, stream=True))
        while not sending.done():  # a client that hangs up before the answer hangs up on the gateway too
            await asyncio.wait({sending}, timeout=DISCONNECT_POLL_S)
            if not sending.done() and await request.is_disconnected():
                sending.cancel()
                write({**entry, "status": 499, "error": "the client disconnected before the answer began"})
                return Response(status_code=499)
        try:
            resp = sending.result()
        except httpx.HTTPError as exc:
            write({**entry, "status": 502, "error": f"proxy could not reach the gateway: {exc!r}"})
            return Response(status_code=502)
        entry["status"] = resp.status_code
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        if resp.status_code >= 400:
            raw = await resp.aread()
            await resp.aclose()
            write({**entry, "error": _error_message(raw)})
            return Response(raw, status_code=resp.status_code, headers=out_headers)

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in resp.aiter_raw():
                yield chunk

        async def done() -> None:
            await resp.aclose()
            write(entry)

        return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers,
                                 background=BackgroundTask(done))  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0))
        yield
        await state["client"].aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def read_log(path: Path, key: str | None = None) -> list[dict[str, Any]]:
    """The exchanges a proxy logged (only those sent with `key`, if given)."""
    if not path.exists():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return entries if key is None else [e for e in entries if e.get("key_hash") == key_hash(key)]


def main(argv: list[str] | None = None) -> int:
    """Serve the proxy until interrupted."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the gateway's base URL")
    p.add_argument("--log", required=True, help="JSON-lines file the exchanges are appended to")
    args = p.parse_args(argv)
    app = build_app(args.upstream.rstrip("/"), Path(args.log))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
