"""The gateway: an ASGI app with the model API (rollout keys) and the control API (admin key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.gateway import control
from harnessrl.gateway.errors import APIError, from_validation_error
from harnessrl.gateway.http import bearer, guarded, read_json
from harnessrl.gateway.keys import KeyRing, new_secret
from harnessrl.gateway.openai_chat import (
    BadUpstreamResponse,
    ChatCompletionRequest,
    client_response,
    effective_temperature,
    token_record,
    upstream_request,
)
from harnessrl.gateway.upstream import Upstream, UpstreamClientError, UpstreamFailed
from harnessrl.schema import Call, CallStatus, Rollout, now
from harnessrl.store import Store

log = logging.getLogger(__name__)


class GatewayConfig(BaseModel):
    """Settings of one gateway process."""

    admin_key: str = Field(min_length=8)
    upstream_url: str = "http://127.0.0.1:8100"
    served_model: str = "smollm2"
    model_map: dict[str, str] = Field(default_factory=dict)  # harness model name -> served model name
    default_max_tokens: int = 512
    pause_wait_s: float = 30.0  # how long a call waits for resume before getting 429
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0
    upstream_retries: int = 3


class Gateway:
    """State shared by the handlers: store, keys, upstream, pause state and in-flight calls."""

    def __init__(self, config: GatewayConfig, store: Store, upstream: Upstream | None = None) -> None:
        self.config = config
        self.store = store
        self.keys = KeyRing(store.set_meta_if_absent("key_secret", new_secret()))
        self.upstream = upstream or Upstream(
            "engine0",
            config.upstream_url,
            timeout_s=config.upstream_timeout_s,
            max_retries=config.upstream_retries,
        )
        self.weight_version: int | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    # auth -----------------------------------------------------------------------------------------
    def require_admin(self, request: Request) -> None:
        """Raise 401/403 unless the request carries the admin key."""
        key = bearer(request)
        if key is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <admin key>'")
        if key == self.config.admin_key:
            return
        if self.keys.verify(key) is not None:
            raise APIError(403, "a rollout key cannot use the control API")
        raise APIError(401, "invalid API key")

    def rollout_for(self, request: Request, path_rollout: str | None) -> Rollout:
        """The rollout a model-API request acts for, checking its key (401) and scope (403)."""
        key = bearer(request)
        if key is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <rollout key>'")
        rollout_id = self.keys.verify(key)
        if rollout_id is None:
            raise APIError(401, "invalid API key: use the key issued for this rollout")
        if path_rollout is not None and path_rollout != rollout_id:
            raise APIError(403, f"this key does not belong to rollout '{path_rollout}'")
        rollout = self.store.get_rollout(rollout_id)
        if rollout is None:
            raise APIError(401, "the rollout of this key does not exist in this gateway's store")
        if rollout.state.finished:
            raise APIError(409, f"rollout '{rollout_id}' is {rollout.state}; it accepts no more calls")
        return rollout

    # pause ----------------------------------------------------------------------------------------
    async def pause(self, drain_timeout_s: float) -> bool:
        """Stop admitting calls and wait for in-flight ones; True if drained in time."""
        self._resumed.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=drain_timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(self, weight_version: int | None) -> None:
        """Admit calls again, optionally recording the engine's new weight version."""
        if weight_version is not None:
            self.weight_version = weight_version
        self._resumed.set()

    @property
    def paused(self) -> bool:
        """True while new calls are held back."""
        return not self._resumed.is_set()

    async def _admit(self) -> None:
        if not self._resumed.is_set():
            try:
                await asyncio.wait_for(self._resumed.wait(), timeout=self.config.pause_wait_s)
            except TimeoutError:
                raise APIError(
                    429,
                    "the gateway is paused for a weight update; retry shortly",
                    code="paused",
                    headers={"Retry-After": "5"},
                ) from None
        self.in_flight += 1
        self._idle.clear()

    def _release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # the chat face --------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        """`POST /v1/chat/completions`: forward, record the call with its tokens, answer."""
        rollout = self.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, self.config.max_body_bytes)
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        served = self.config.model_map.get(req.model, self.config.served_model)
        up_body = upstream_request(req, served, rollout.sampling, self.config.default_max_tokens)
        await self._admit()
        try:
            return await self._forward(rollout, req, body, up_body)
        finally:
            self._release()

    async def _forward(
        self, rollout: Rollout, req: ChatCompletionRequest, body: dict[str, Any], up_body: dict[str, Any]
    ) -> Response:
        started = now()
        t0 = time.perf_counter()
        call = Call(
            call_id="call" + uuid.uuid4().hex,
            rollout_id=rollout.rollout_id,
            attempt=max(rollout.n_attempts - 1, 0),
            created_at=started,
            latency_s=0.0,
            status=CallStatus.FAILED,
            model=up_body["model"],
            upstream=self.upstream.name,
            request=body,
            temperature=effective_temperature(req, rollout.sampling),
        )
        try:
            resp = await self.upstream.post("/v1/chat/completions", up_body)
            record = token_record(resp)
        except UpstreamClientError as e:
            raise APIError(400, f"the model rejected the request: {e.message}") from None
        except (UpstreamFailed, BadUpstreamResponse) as e:
            call = call.model_copy(update={"latency_s": time.perf_counter() - t0, "error": str(e)})
            self.store.add_call(call)
            log.error("call_failed rollout=%s error=%s", rollout.rollout_id, e)
            raise APIError(502, f"the model failed to answer: {e}", code="upstream_failed") from None
        out = client_response(resp, req)
        version = record.weight_version if record.weight_version is not None else self.weight_version
        call = call.model_copy(
            update={
                "latency_s": time.perf_counter() - t0,
                "status": CallStatus.OK,
                "response": out,
                "prompt_ids": record.prompt_ids,
                "completion_ids": record.completion_ids,
                "completion_logprobs": record.completion_logprobs,
                "weight_version": version,
                "finish_reason": record.finish_reason,
            }
        )
        self.store.add_call(call)  # committed before the harness sees the answer
        return JSONResponse(out)


def create_app(config: GatewayConfig, store: Store, upstream: Upstream | None = None) -> Starlette:
    """Build the gateway ASGI app over `store`."""
    holder: dict[str, Gateway] = {}

    def gw() -> Gateway:
        return holder["gw"]

    async def chat(request: Request) -> Response:
        return await gw().chat_completions(request)

    async def models(request: Request) -> Response:
        gw().rollout_for(request, request.path_params.get("rollout_id"))
        names = sorted({config.served_model, *config.model_map})
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "harnessrl"} for n in names]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/health", guarded(health), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/r/{rollout_id}/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/r/{rollout_id}/v1/models", guarded(models), methods=["GET"]),
        *[Route(path, guarded(fn), methods=[m]) for path, m, fn in control.routes(gw)],
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        holder["gw"] = Gateway(config, store, upstream)
        app.state.gateway = holder["gw"]
        try:
            yield
        finally:
            await holder["gw"].upstream.aclose()

    return Starlette(routes=routes, lifespan=lifespan)
