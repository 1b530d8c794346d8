"""The dashboard's Starlette app: static pages and a read-only JSON API over `data.RunData`.

Routes (all GET; anything else is 405):

    /                          the single page (static/index.html; views are chosen by the URL hash)
    /static/...                its script and style
    /api/run                   overview: id, name, model, settings, summary, rollouts by phase and state
    /api/steps                 metrics.jsonl records (reward, held-out, loss, KL, entropy, lengths, times)
    /api/groups?step=N         the groups of a step with their rewards and zero-variance flag
    /api/rollouts?...          a page of rollouts: phase, step, group, task, state (or failed),
                               zero_variance, reward_min, reward_max, offset, limit
    /api/rollouts/{id}         one rollout: calls with conversation and tool calls, rows token by token
    /api/suspects?checks=KEY   rollouts whose reward rose while their checks (details[KEY], default
                               "passed") did not, against another rollout of the same task (suspects.py);
                               phase (default train)
    /api/live                  server-sent events: a message whenever the run records something

With an admin key every request needs it: `Authorization: Bearer KEY`, or `?key=KEY` once (it is then
kept in an HttpOnly cookie). Bad parameters answer 400 naming the parameter; an unknown rollout 404.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from harnessrl.dashboard.data import Filters, RunData
from harnessrl.inspection.runview import RunError
from harnessrl.schema import RolloutState

log = logging.getLogger(__name__)

STATIC = Path(__file__).with_name("static")
COOKIE = "harnessrl_dashboard"
LIVE_POLL_S = 1.0
LIVE_MAX_S = 600.0  # a stream ends after this; the browser's EventSource reconnects by itself
PHASES = ("train", "eval", "other", "all")
STATES = tuple(s.value for s in RolloutState)  # "failed" also matches cancelled


class BadParam(ValueError):
    """A query parameter that cannot be used; answered with 400 naming it."""


def _num(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _num(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_num(x) for x in v]
    return v


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(_num(data), status, headers={"Cache-Control": "no-store"})


def _number(q: Any, name: str, kind: type[int] | type[float]) -> int | float | None:
    """Query parameter `name` as `kind`, None when absent or empty; 400 (BadParam) otherwise."""
    raw = q.get(name)
    if raw in (None, ""):
        return None
    try:
        return kind(raw)
    except ValueError as e:
        what = "an integer" if kind is int else "a number"
        raise BadParam(f"{name} must be {what}, not {raw!r}") from e


def _int(q: Any, name: str, default: int | None, lo: int | None = None) -> int | None:
    value = _number(q, name, int)
    if value is None:
        return default
    if lo is not None and value < lo:
        raise BadParam(f"{name} must be >= {lo}, not {value}")
    return int(value)


def _float(q: Any, name: str) -> float | None:
    value = _number(q, name, float)
    if value is not None and not math.isfinite(value):
        raise BadParam(f"{name} must be finite")
    return value


def parse_filters(q: Any) -> Filters:
    """The listing filters of a query string (400 on a bad value)."""
    phase = q.get("phase") or "train"
    if phase not in PHASES:
        raise BadParam(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
    state = q.get("state") or None
    if state is not None and state not in STATES:
        raise BadParam(f"state must be one of {', '.join(STATES)}, not {state!r}")
    zv = q.get("zero_variance", "")
    if zv not in ("", "0", "1", "true", "false"):
        raise BadParam(f"zero_variance must be 1 or 0, not {zv!r}")
    return Filters(
        phase=None if phase == "all" else phase, step=_int(q, "step", None), group=q.get("group") or None,
        task=q.get("task") or None, state=state, zero_variance=zv in ("1", "true"),
        reward_min=_float(q, "reward_min"), reward_max=_float(q, "reward_max"),
    )  # fmt: skip


class KeyMiddleware(BaseHTTPMiddleware):
    """Every request must carry the admin key (header, cookie, or `?key=` which sets the cookie)."""

    def __init__(self, app: Any, key: str) -> None:
        super().__init__(app)
        self.key = key

    def _ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.key.encode())

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else None
        if self._ok(bearer) or self._ok(request.cookies.get(COOKIE)):
            return await call_next(request)
        if self._ok(request.query_params.get("key")):
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
            # the same path on this server ("//host" would send the browser elsewhere), the key dropped
            target = "/" + request.url.path.lstrip("/") + ("?" + urlencode(rest) if rest else "")
            resp = RedirectResponse(target, status_code=303)
            resp.set_cookie(COOKIE, self.key, httponly=True, samesite="strict")
            return resp
        return JSONResponse({"error": "this dashboard needs its admin key: open it with ?key=KEY once, "
                             "or send Authorization: Bearer KEY"}, 401)  # fmt: skip


def _json_endpoint(fn: Callable[[Request], Any]) -> Callable[[Request], Awaitable[Response]]:
    """Run `fn` off the event loop and answer its result as JSON; a bad parameter is a 400, an unknown
    rollout or an unreadable run a 404."""

    async def endpoint(request: Request) -> Response:
        try:
            return _json(await asyncio.to_thread(fn, request))
        except BadParam as e:
            return _json({"error": str(e)}, 400)
        except RunError as e:
            return _json({"error": str(e)}, 404)

    return endpoint


class DashboardRoutes:
    """The dashboard's handlers over one run's data; `routes()` is its route table."""

    def __init__(self, data: RunData) -> None:
        self.data = data

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    def rollouts(self, request: Request) -> Any:
        q = request.query_params
        f = parse_filters(q)
        offset = _int(q, "offset", 0, lo=0) or 0
        limit = _int(q, "limit", 50, lo=1) or 50
        return self.data.rollouts(f, offset, limit)

    def groups(self, request: Request) -> Any:
        q = request.query_params
        phase = q.get("phase") or "train"
        if phase not in PHASES:
            raise BadParam(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
        return {"groups": self.data.groups(_int(q, "step", None), None if phase == "all" else phase)}

    def suspects(self, request: Request) -> Any:
        q = request.query_params
        checks = q.get("checks") or "passed"
        if not re.fullmatch(r"[A-Za-z_][\w.-]{0,63}", checks):
            raise BadParam(f"checks must name a detail of the grader's reward (e.g. passed), not {checks!r}")
        phase = q.get("phase") or "train"
        if phase not in PHASES:
            raise BadParam(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
        return self.data.suspects(checks, None if phase == "all" else phase)

    async def live(self, request: Request) -> Response:
        """Server-sent events: the run's live token whenever it changes (for at most LIVE_MAX_S)."""

        async def stream() -> AsyncIterator[str]:
            last: dict[str, Any] | None = None
            waited = 0.0
            yield "retry: 2000\n\n"
            while waited < LIVE_MAX_S:
                token = await asyncio.to_thread(self.data.live_token)
                if token != last:
                    last = token
                    yield f"data: {json.dumps(token)}\n\n"
                if await request.is_disconnected():
                    return
                await asyncio.sleep(LIVE_POLL_S)
                waited += LIVE_POLL_S

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})  # fmt: skip

    def routes(self) -> list[BaseRoute]:
        """Every route of the dashboard."""
        data = self.data
        return [
            Route("/", self.index),
            Route("/api/run", _json_endpoint(lambda r: data.overview())),
            Route("/api/steps", _json_endpoint(lambda r: data.steps())),
            Route("/api/groups", _json_endpoint(self.groups)),
            Route("/api/rollouts", _json_endpoint(self.rollouts)),
            Route(
                "/api/rollouts/{rollout_id}",
                _json_endpoint(lambda r: data.rollout(r.path_params["rollout_id"])),
            ),
            Route("/api/suspects", _json_endpoint(self.suspects)),
            Route("/api/live", self.live),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]


def create_dashboard(data: RunData, admin_key: str | None = None) -> Starlette:
    """The dashboard app over `data`; with `admin_key` every request must carry that key."""
    middleware = [Middleware(KeyMiddleware, key=admin_key)] if admin_key else []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        data.close()

    return Starlette(routes=DashboardRoutes(data).routes(), middleware=middleware, lifespan=lifespan)
