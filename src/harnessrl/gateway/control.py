"""The control API (admin key): rollouts, attempts, rewards, pause and resume."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.http import Handler, RouteSpec, read_json
from harnessrl.gateway.keys import new_rollout_id, valid_rollout_id
from harnessrl.gateway.state import Gateway
from harnessrl.schema import (
    SQL_INT_LIMIT,
    AttemptFinish,
    PauseRequest,
    ResumeRequest,
    RewardIn,
    RolloutCreate,
    RolloutCreated,
    RolloutPage,
    RolloutState,
    StateChange,
)
from harnessrl.store import Conflict, NotFound, StoreError

M = TypeVar("M", bound=BaseModel)


async def _body(request: Request, model: type[M], gw: Gateway) -> M:
    data = await read_json(request, gw.config.max_body_bytes, empty={})
    return validate(model, data)


def _rollout_id(request: Request) -> str:
    rid = str(request.path_params["rollout_id"])
    if not valid_rollout_id(rid):
        raise APIError(404, f"rollout '{rid}' not found")
    return rid


def _store_error(e: StoreError) -> APIError:
    if isinstance(e, NotFound):
        return APIError(404, str(e))
    if isinstance(e, Conflict):
        return APIError(409, str(e))
    return APIError(400, str(e))


KEEPALIVE_S = 15.0


async def _event_stream(g: Gateway, request: Request, after: int) -> AsyncIterator[str]:
    """Replay state changes after `after` from the store, then push new ones as they happen."""
    while not await request.is_disconnected():
        batch = g.store.events(after=after, limit=500)
        for ev in batch:
            after = ev.seq
            yield f"id: {ev.seq}\nevent: rollout\ndata: {ev.model_dump_json()}\n\n"
        if not batch:
            if g.store.pushes_events:  # a shared database: other replicas' writes wake the wait too
                await asyncio.to_thread(g.store.wait_events, after, KEEPALIVE_S)
            else:
                await g.wait_events(KEEPALIVE_S)
            if not g.store.events(after=after, limit=1):
                yield ": keepalive\n\n"


AdminHandler = Callable[[Request, Gateway], Awaitable[Response]]

LIST_QUERY = (
    {"name": "state", "in": "query", "schema": {"type": "string", "enum": [s.value for s in RolloutState]}},
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
    {"name": "cursor", "in": "query", "schema": {"type": "string", "pattern": "^[0-9]+$"}},
)
EVENTS_QUERY = ({"name": "after", "in": "query", "schema": {"type": "string", "pattern": "^[0-9]+$"}},)


class ControlRoutes:
    """The control API's handlers (admin key): each needs the admin key, and a store error becomes
    404 (not found), 409 (conflict) or 400. `table()` lists them with their OpenAPI entries."""

    def __init__(self, gw: Callable[[], Gateway]) -> None:
        self._gw = gw

    def _admin(self, handler: AdminHandler) -> Handler:
        async def run(request: Request) -> Response:
            g = self._gw()
            g.require_admin(request)
            try:
                return await handler(request, g)
            except StoreError as e:
                raise _store_error(e) from None

        return run

    async def create(self, request: Request, g: Gateway) -> Response:
        req = await _body(request, RolloutCreate, g)
        rollout, created = g.store.create_rollout(req, new_rollout_id())
        if created:
            await g.notify_events()
        out = RolloutCreated(rollout=rollout, api_key=g.keys.issue(rollout.rollout_id), created=created)
        return JSONResponse(out.model_dump(mode="json"), status_code=201 if created else 200)

    async def list_(self, request: Request, g: Gateway) -> Response:
        q = request.query_params
        try:
            state = RolloutState(q["state"]) if "state" in q else None
            limit = int(q.get("limit", "100"))
            after = int(q.get("cursor", "0"))
        except ValueError:
            raise APIError(400, "state must be a rollout state; limit and cursor must be integers") from None
        if not 1 <= limit <= 1000:
            raise APIError(400, "limit must be between 1 and 1000", param="limit")
        if not 0 <= after < SQL_INT_LIMIT:
            raise APIError(400, "cursor must be a value returned as next_cursor", param="cursor")
        page, nxt = g.store.list_rollouts(state=state, limit=limit, after=after)
        body = RolloutPage(rollouts=page, next_cursor=None if nxt is None else str(nxt))
        return JSONResponse(body.model_dump(mode="json"))

    async def read(self, request: Request, g: Gateway) -> Response:
        detail = g.store.detail(_rollout_id(request))
        return JSONResponse(detail.model_dump(mode="json"))

    async def start_attempt(self, request: Request, g: Gateway) -> Response:
        try:
            attempt = g.store.start_attempt(_rollout_id(request))
        finally:
            g.forget(str(request.path_params["rollout_id"]))
        await g.notify_events()
        return JSONResponse(attempt.model_dump(mode="json"), status_code=201)

    async def finish_attempt(self, request: Request, g: Gateway) -> Response:
        finish = await _body(request, AttemptFinish, g)
        try:
            n = int(request.path_params["attempt"])
            if not 0 <= n < SQL_INT_LIMIT:
                raise ValueError(n)
            attempt = g.store.finish_attempt(_rollout_id(request), n, finish)
        except ValueError:
            raise APIError(404, "attempt must be an integer") from None
        return JSONResponse(attempt.model_dump(mode="json"))

    async def set_state(self, request: Request, g: Gateway) -> Response:
        change = await _body(request, StateChange, g)
        try:
            rollout = g.store.set_state(_rollout_id(request), change.state)
        finally:
            g.forget(str(request.path_params["rollout_id"]))
        await g.notify_events()
        return JSONResponse(rollout.model_dump(mode="json"))

    async def reward(self, request: Request, g: Gateway) -> Response:
        value = await _body(request, RewardIn, g)
        stored = g.store.set_reward(_rollout_id(request), value)
        return JSONResponse(stored.model_dump(mode="json"))

    async def pause(self, request: Request, g: Gateway) -> Response:
        req = await _body(request, PauseRequest, g)
        drained = await g.pause(req.drain_timeout_s, req.preempt)
        return JSONResponse({"paused": True, "drained": drained, "in_flight": g.in_flight,
                             "preempted_calls": g.preempted_calls})  # fmt: skip

    async def resume(self, request: Request, g: Gateway) -> Response:
        req = await _body(request, ResumeRequest, g)
        g.resume(req.weight_version)
        return JSONResponse({"paused": False, "weight_version": g.weight_version})

    async def events(self, request: Request, g: Gateway) -> Response:
        raw = request.query_params.get("after", request.headers.get("last-event-id", "0"))
        if not (raw.isdigit() and int(raw) < SQL_INT_LIMIT):
            raise APIError(
                400, "after must be a non-negative integer (an event sequence number)", param="after"
            )
        return StreamingResponse(
            _event_stream(g, request, int(raw)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def status(self, request: Request, g: Gateway) -> Response:
        return JSONResponse(
            {"paused": g.paused, "in_flight": g.in_flight, "weight_version": g.weight_version}
        )

    def table(self) -> list[RouteSpec]:
        """Every control route with its OpenAPI entry."""
        rows: list[tuple[str, str, AdminHandler, str, type[BaseModel] | None, tuple[dict, ...]]] = [
            ("/control/rollouts", "POST", self.create, "create a rollout (idempotent by client_id)", RolloutCreate, ()),
            ("/control/rollouts", "GET", self.list_, "list rollouts", None, LIST_QUERY),
            ("/control/rollouts/{rollout_id}", "GET", self.read, "a rollout with its calls", None, ()),
            ("/control/rollouts/{rollout_id}/attempts", "POST", self.start_attempt, "start an attempt", None, ()),
            ("/control/rollouts/{rollout_id}/attempts/{attempt}/finish", "POST", self.finish_attempt,
             "finish an attempt", AttemptFinish, ()),
            ("/control/rollouts/{rollout_id}/state", "POST", self.set_state, "change state", StateChange, ()),
            ("/control/rollouts/{rollout_id}/reward", "PUT", self.reward, "write the reward", RewardIn, ()),
            ("/control/pause", "POST", self.pause, "pause and drain", PauseRequest, ()),
            ("/control/resume", "POST", self.resume, "resume", ResumeRequest, ()),
            ("/control/status", "GET", self.status, "gateway state", None, ()),
            ("/control/events", "GET", self.events, "a stream of rollout state changes (server-sent events)",
             None, EVENTS_QUERY),
        ]  # fmt: skip
        return [
            RouteSpec(
                path, method, self._admin(fn), summary, body, "adminKey", query, streams=fn == self.events
            )
            for path, method, fn, summary, body, query in rows
        ]
