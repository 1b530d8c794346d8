"""The gateway: an ASGI app with the model API (rollout keys) and the control API (admin key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from harnessrl.defaults import DEFAULT_MAX_TOKENS, ROLLOUT_CACHE_SIZE
from harnessrl.gateway import control
from harnessrl.gateway.access import Access
from harnessrl.gateway.admission import Admission
from harnessrl.gateway.budget import ContextBudget
from harnessrl.gateway.call_annotations import annotate as annotate_call
from harnessrl.gateway.calls import ModelCalls
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.engine_client.sglang import SGLangUpstream
from harnessrl.gateway.engine_client.upstream import Upstream, UpstreamPool
from harnessrl.gateway.errors import APIError, ErrorLog, validate
from harnessrl.gateway.faces import Face
from harnessrl.gateway.faces.anthropic import AnthropicFace
from harnessrl.gateway.faces.models import model_card, model_list, wants_anthropic
from harnessrl.gateway.faces.openai_chat import OpenAIChatFace
from harnessrl.gateway.faces.responses import ResponsesFace
from harnessrl.gateway.http import Handler, guarded, read_json
from harnessrl.gateway.keys import KeyRing, new_secret
from harnessrl.gateway.metrics import Metrics
from harnessrl.gateway.openapi import openapi_document
from harnessrl.gateway.recording import CallRecorder
from harnessrl.schema import RewardIn, Rollout
from harnessrl.store import Store

log = logging.getLogger(__name__)


class GatewayConfig(BaseModel):
    """Settings of one gateway process."""

    admin_key: str = Field(min_length=8)
    upstream_url: str = "http://127.0.0.1:8100"
    replica_urls: list[str] = Field(
        default_factory=list
    )  # more replicas of the same model (sticky per rollout)
    served_model: str = "smollm2"
    model_map: dict[str, str] = Field(default_factory=dict)  # harness model name -> served model name
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    pause_wait_s: float = 30.0  # how long a call waits for resume before getting 429
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0  # one try: the whole answer, or between two streamed pieces
    upstream_retries: int = 3
    stream_open_timeout_s: float = 30.0  # one streamed try: until the engine's headers (sent at once)
    call_timeout_s: float = 600.0  # every try of one call together, on all replicas (a pause can drain)
    rollout_cache_size: int = Field(default=ROLLOUT_CACHE_SIZE, ge=1)  # rollouts kept in memory (LRU out)
    mode: Literal["passthrough", "tito"] = "passthrough"
    tokenizer_path: str | None = None  # model directory with tokenizer.json; required for tito
    # wire of the upstream: "openai" = the engine protocol (builtin engine, vLLM's OpenAI server);
    # "sglang" = SGLang's native /generate (token IDs in and out; needs tito mode)
    upstream_kind: Literal["openai", "sglang"] = "openai"
    sglang_incremental_streaming: bool = False  # the SGLang server runs --incremental-streaming-output

    @model_validator(mode="after")
    def _mode_rules(self) -> GatewayConfig:
        """The one place these rules are checked (the gateway's command line builds this model too)."""
        if self.mode == "tito" and not self.tokenizer_path:
            raise ValueError("tito mode needs tokenizer_path (a model directory with tokenizer.json)")
        if self.upstream_kind == "sglang" and self.mode != "tito":
            raise ValueError(
                "upstream_kind 'sglang' needs mode 'tito' (SGLang returns token IDs only from /generate)"
            )
        return self


class Gateway:
    """The state the handlers share: store, access (keys, rollout cache), admission (in flight, pause),
    the call recorder, the engine replicas and metrics. The model API's handlers are `calls.ModelCalls`,
    the control API's `control.routes`."""

    def __init__(self, config: GatewayConfig, store: Store, upstreams: list[Upstream] | None = None) -> None:
        self.config = config
        self.store = store
        self.keys = KeyRing(store.set_meta_if_absent("key_secret", new_secret()))
        # A store other gateway replicas write too (PostgreSQL): their attempts, state changes and calls
        # would not reach this process's memory, so rollouts and recent calls are read from the store.
        shared = store.pushes_events
        self.access = Access(config.admin_key, self.keys, store, 0 if shared else config.rollout_cache_size)
        urls = [config.upstream_url, *config.replica_urls]
        kind = SGLangUpstream if config.upstream_kind == "sglang" else Upstream
        built = [kind(f"engine{i}", url, timeout_s=config.upstream_timeout_s, max_retries=config.upstream_retries,
                      open_timeout_s=config.stream_open_timeout_s) for i, url in enumerate(urls)]  # fmt: skip
        for u in built:
            if isinstance(u, SGLangUpstream):
                u.incremental_streaming = config.sglang_incremental_streaming
        self.upstreams = UpstreamPool(upstreams or list(built), call_timeout_s=config.call_timeout_s)
        self.weight_version: int | None = None
        self.tito: TitoTokenizer | None = None
        if config.mode == "tito" and config.tokenizer_path:  # GatewayConfig requires the path for tito
            self.tito = TitoTokenizer.from_dir(config.tokenizer_path)
        self.admission = Admission(config.pause_wait_s)
        self.metrics = Metrics()
        self.recorder = CallRecorder(store, self.metrics, lambda: self.weight_version, remember=not shared)
        self.budget = ContextBudget(self.tito)  # max_tokens vs the served model's context
        self.calls = ModelCalls(self)
        self.metrics.gauge(
            "harnessrl_gateway_paused", "1 while the gateway holds new calls.", lambda: float(self.paused)
        )
        self.metrics.gauge(
            "harnessrl_gateway_in_flight", "Model calls being served.", lambda: float(self.in_flight)
        )
        self._event_seq = asyncio.Condition()

    def require_admin(self, request: Request) -> None:
        """Raise 401/403 unless the request carries the admin key."""
        self.access.require_admin(request)

    def rollout_for(self, request: Request, path_rollout: str | None) -> Rollout:
        """The rollout a model-API request acts for (see `Access.rollout_for`)."""
        return self.access.rollout_for(request, path_rollout)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout from the cache after the control API changed it."""
        self.access.rollouts.forget(rollout_id)

    def served_model(self, requested: str) -> str:
        """The model that serves a request naming `requested` (any name is served)."""
        return self.config.model_map.get(requested, self.config.served_model)

    # pause ----------------------------------------------------------------------------------------
    async def pause(self, drain_timeout_s: float, preempt: bool = False) -> bool:
        """Stop admitting calls and wait for in-flight ones; True if drained (see `Admission.pause`)."""
        return await self.admission.pause(drain_timeout_s, preempt)

    def resume(self, weight_version: int | None) -> None:
        """Admit calls again, optionally recording the engine's new weight version."""
        if weight_version is not None:
            self.weight_version = weight_version
        self.admission.resume()

    @property
    def paused(self) -> bool:
        """True while new calls are held back."""
        return self.admission.paused

    @property
    def in_flight(self) -> int:
        """Model calls being served."""
        return self.admission.in_flight

    @property
    def preempted_calls(self) -> int:
        """Non-streamed calls cut by preempting pauses (and sent again) so far."""
        return self.admission.preempted_calls

    # errors and events ----------------------------------------------------------------------------
    def count_error(self, status: int) -> None:
        """Count a request answered with an error status."""
        self.metrics.inc(
            "harnessrl_gateway_errors_total", "Requests answered with an error.", status=str(status)
        )

    async def notify_events(self) -> None:
        """Wake event-stream readers: a rollout changed state."""
        async with self._event_seq:
            self._event_seq.notify_all()

    async def wait_events(self, timeout_s: float) -> None:
        """Wait until `notify_events` or the timeout."""
        async with self._event_seq:
            try:
                await asyncio.wait_for(self._event_seq.wait(), timeout=timeout_s)
            except TimeoutError:
                pass


def create_app(config: GatewayConfig, store: Store, upstreams: list[Upstream] | None = None) -> Starlette:
    """Build the gateway ASGI app over `store`."""
    holder: dict[str, Gateway] = {}

    def gw() -> Gateway:
        return holder["gw"]

    faces: list[tuple[str, Face]] = [
        ("/v1/chat/completions", OpenAIChatFace()),
        ("/v1/messages", AnthropicFace()),
        ("/v1/responses", ResponsesFace()),
    ]

    errors = ErrorLog(log)  # every error answer is logged with its reason (rate-limited)

    def logged(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                errors.report(request.method, request.url.path, e.status, e.message)
                raise

        return run

    def counted(handler: Handler, style: str = "openai") -> Handler:
        return guarded(logged(handler), style, on_error=lambda status: gw().count_error(status))

    def face_handler(face: Face) -> Handler:
        async def handle(request: Request) -> Response:
            return await gw().calls.chat(request, face)

        return counted(handle, face.error_style)

    async def completion(request: Request) -> Response:
        return await gw().calls.completion(request)

    def served_by(name: str) -> str:
        return config.model_map.get(name, config.served_model)

    async def models(request: Request) -> Response:
        gw().rollout_for(request, request.path_params.get("rollout_id"))
        names = sorted({config.served_model, *config.model_map})
        listing = model_list(names, wants_anthropic(request.headers), {n: served_by(n) for n in names})
        return JSONResponse(listing)

    async def model(request: Request) -> Response:  # any name a client sends is served
        gw().rollout_for(request, request.path_params.get("rollout_id"))
        name = request.path_params["model_id"]
        return JSONResponse(model_card(name, wants_anthropic(request.headers), served_by(name)))

    async def count_tokens(request: Request) -> Response:
        return await gw().calls.count_tokens(request)

    async def self_reward(request: Request) -> Response:
        g = gw()
        rollout = g.rollout_for(request, request.path_params.get("rollout_id"))
        if rollout.metadata.get("allow_self_reward") is not True:
            raise APIError(403, "this rollout's task does not let the harness write its reward")
        value = validate(RewardIn, await read_json(request, g.config.max_body_bytes))
        stored = g.store.set_reward(rollout.rollout_id, value)
        return JSONResponse(stored.model_dump(mode="json"))

    async def annotate(request: Request) -> Response:
        return await annotate_call(gw(), request)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    spec = openapi_document()

    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    async def metrics(request: Request) -> Response:
        gw().require_admin(request)  # counters span every rollout: not for a harness's key
        return PlainTextResponse(gw().metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/health", guarded(health), methods=["GET"]),
        Route("/metrics", guarded(logged(metrics)), methods=["GET"]),
        Route("/openapi.json", guarded(openapi), methods=["GET"]),
        *[Route(path, face_handler(face), methods=["POST"]) for path, face in faces],
        *[Route(f"/r/{{rollout_id}}{path}", face_handler(face), methods=["POST"]) for path, face in faces],
        Route("/v1/completions", counted(completion), methods=["POST"]),
        Route("/r/{rollout_id}/v1/completions", counted(completion), methods=["POST"]),
        Route("/v1/models", guarded(logged(models)), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guarded(logged(model)), methods=["GET"]),
        Route("/r/{rollout_id}/v1/models/{model_id:path}", guarded(logged(model)), methods=["GET"]),
        Route("/v1/messages/count_tokens", counted(count_tokens, "anthropic"), methods=["POST"]),
        Route(
            "/r/{rollout_id}/v1/messages/count_tokens", counted(count_tokens, "anthropic"), methods=["POST"]
        ),
        Route("/v1/harnessrl/reward", guarded(logged(self_reward)), methods=["PUT"]),
        Route("/r/{rollout_id}/v1/harnessrl/reward", guarded(logged(self_reward)), methods=["PUT"]),
        Route("/v1/harnessrl/annotations", guarded(logged(annotate)), methods=["POST"]),
        Route("/r/{rollout_id}/v1/harnessrl/annotations", guarded(logged(annotate)), methods=["POST"]),
        Route("/r/{rollout_id}/v1/models", guarded(logged(models)), methods=["GET"]),
        *[Route(path, guarded(logged(fn)), methods=[m]) for path, m, fn in control.routes(gw)],
    ]

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

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
