"""The gateway's ASGI app: the model API (rollout keys, `model_api`), the control API (admin key,
`control`) and its own routes (health, metrics, the OpenAPI document), built from their route tables
over one `Gateway` state (`state`), which the app's lifespan creates and closes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from harnessrl.gateway.control import ControlRoutes
from harnessrl.gateway.engine_client.upstream import Upstream
from harnessrl.gateway.errors import APIError, ErrorLog
from harnessrl.gateway.http import Handler, RouteSpec, guarded
from harnessrl.gateway.model_api import ModelAPIRoutes
from harnessrl.gateway.openapi import openapi_document
from harnessrl.gateway.state import Gateway, GatewayConfig
from harnessrl.store import Store

log = logging.getLogger(__name__)

__all__ = ["Gateway", "GatewayConfig", "create_app", "gateway_openapi", "route_table"]


def route_table(gw: Callable[[], Gateway]) -> list[RouteSpec]:
    """Every route of the gateway over the state `gw()` returns (health and the OpenAPI document are
    open; `/metrics` needs the admin key: its counters span every rollout)."""

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def metrics(request: Request) -> Response:
        gw().require_admin(request)
        return PlainTextResponse(gw().metrics.render(), media_type="text/plain; version=0.0.4")

    own = [
        RouteSpec("/health", "GET", health, "liveness", security=None, logged=False),
        RouteSpec("/metrics", "GET", metrics, "Prometheus metrics", security="adminKey"),
    ]
    specs = own + ModelAPIRoutes(gw).table() + ControlRoutes(gw).table()
    document = openapi_document([*specs, _openapi_spec(lambda: {})])

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    return [*specs, _openapi_spec(openapi)]


def _openapi_spec(handler: Any) -> RouteSpec:
    return RouteSpec("/openapi.json", "GET", handler, "this document", security=None, logged=False)


def gateway_openapi() -> dict[str, Any]:
    """The gateway's OpenAPI document (no gateway needs to run)."""

    def no_state() -> Gateway:
        raise RuntimeError("the gateway is not running")

    return openapi_document(route_table(no_state))


def create_app(config: GatewayConfig, store: Store, upstreams: list[Upstream] | None = None) -> Starlette:
    """Build the gateway ASGI app over `store`."""
    holder: dict[str, Gateway] = {}

    def gw() -> Gateway:
        return holder["gw"]

    errors = ErrorLog(log)  # every error answer is logged with its reason (rate-limited)

    def logged(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                errors.report(request.method, request.url.path, e.status, e.message)
                raise

        return run

    def wrap(spec: RouteSpec) -> Handler:
        on_error = (lambda status: gw().count_error(status)) if spec.counted else None
        handler = logged(spec.handler) if spec.logged else spec.handler
        return guarded(handler, spec.error_style, on_error=on_error)

    handlers = [(s, wrap(s)) for s in route_table(gw)]
    routes = [Route(s.path, handler, methods=[s.method]) for s, handler in handlers]
    direct = {(s.method, s.path): handler for s, handler in handlers if "{" not in s.path}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        holder["gw"] = Gateway(config, store, upstreams)
        app.state.gateway = holder["gw"]
        try:
            yield
        finally:
            await holder["gw"].upstreams.aclose()
            holder["gw"].recorder.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        message = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} not allowed on {request.url.path}",
        }
        error = APIError(status, message.get(status, str(getattr(exc, "detail", "error"))))
        errors.report(request.method, request.url.path, status, error.message)
        return error.response()

    return GatewayApp(
        direct, routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}
    )


class GatewayApp(Starlette):
    """Starlette, with the routes of a fixed path (`/v1/chat/completions`, `/v1/messages`, the control
    API's...) served straight from a table: a model call skips the router's scan of every route and the
    two error middlewares with their wrappers around each `send`, whose work the route's own `guarded`
    already does (every exception of a handler becomes an answer there). A path with parameters
    (`/r/{rollout_id}/...`), another method on a known path (405), an unknown path (404) and the
    lifespan go through Starlette as before. With the other cuts of its commit, 1.2x the calls per
    second at 64 clients of the commit before (issue 35; docs/benchmarks.md)."""

    def __init__(self, direct: dict[tuple[str, str], Handler], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a request to a fixed path from the table; anything else as Starlette does."""
        if scope["type"] == "http" and not scope.get("root_path"):
            handler = self._direct.get((scope["method"], scope["path"]))
            if handler is not None:
                scope["app"] = self
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
