"""The gateway: an ASGI app with the model API (rollout keys) and the control API (admin key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from harnessrl.chat import ChatFormatError
from harnessrl.gateway import control
from harnessrl.gateway.errors import APIError, from_validation_error
from harnessrl.gateway.http import bearer, guarded, read_json
from harnessrl.gateway.keys import KeyRing, new_secret
from harnessrl.gateway.openai_chat import (
    BadUpstreamResponse,
    ChatCompletionRequest,
    TokenRecord,
    chat_from_completion,
    client_response,
    completion_token_record,
    effective_temperature,
    tito_upstream_request,
    token_record,
    upstream_request,
)
from harnessrl.gateway.tito import TitoPrompt, build_prompt
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
    mode: Literal["passthrough", "tito"] = "passthrough"
    tokenizer_path: str | None = None  # model directory with tokenizer.json; required for tito


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
        self.tito: TitoTokenizer | None = None
        if config.mode == "tito":
            if not config.tokenizer_path:
                raise ValueError("tito mode needs tokenizer_path (a model directory with tokenizer.json)")
            self.tito = TitoTokenizer.from_dir(config.tokenizer_path)
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
        """`POST /v1/chat/completions`: build the engine request, record the call with its tokens, answer."""
        rollout = self.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, self.config.max_body_bytes)
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        served = self.config.model_map.get(req.model, self.config.served_model)
        await self._admit()
        try:
            if self.tito is None:
                up_body = upstream_request(req, served, rollout.sampling, self.config.default_max_tokens)
                return await self._forward(
                    rollout, req, body, "/v1/chat/completions", up_body, _passthrough_shape
                )
            prompt = self._tito_prompt(rollout, req)
            up_body = tito_upstream_request(
                req,
                served,
                rollout.sampling,
                self.config.default_max_tokens,
                prompt.prompt_ids,
                [self.tito.eos_id],
            )
            return await self._forward(
                rollout, req, body, "/v1/completions", up_body, _tito_shape(prompt.prompt_ids)
            )
        finally:
            self._release()

    def _tito_prompt(self, rollout: Rollout, req: ChatCompletionRequest) -> TitoPrompt:
        assert self.tito is not None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = (
            [t.model_dump(exclude_none=True) for t in req.tools]
            if req.tools and req.tool_choice != "none"
            else None
        )
        attempt = max(rollout.n_attempts - 1, 0)
        history = [c for c in self.store.calls(rollout.rollout_id) if c.attempt == attempt]
        try:
            return build_prompt(messages, tools, history, self.tito.encode, self.tito.eos_id)
        except ChatFormatError as e:
            raise APIError(400, str(e)) from None

    async def _forward(
        self,
        rollout: Rollout,
        req: ChatCompletionRequest,
        body: dict[str, Any],
        path: str,
        up_body: dict[str, Any],
        shape: Shape,
    ) -> Response:
        t0 = time.perf_counter()
        call = Call(
            call_id="call" + uuid.uuid4().hex,
            rollout_id=rollout.rollout_id,
            attempt=max(rollout.n_attempts - 1, 0),
            created_at=now(),
            latency_s=0.0,
            status=CallStatus.FAILED,
            model=up_body["model"],
            upstream=self.upstream.name,
            request=body,
            temperature=effective_temperature(req, rollout.sampling),
        )
        try:
            resp = await self.upstream.post(path, up_body)
            out, record = shape(resp, req)
        except UpstreamClientError as e:
            raise APIError(400, f"the model rejected the request: {e.message}") from None
        except (UpstreamFailed, BadUpstreamResponse) as e:
            call = call.model_copy(update={"latency_s": time.perf_counter() - t0, "error": str(e)})
            self.store.add_call(call)
            log.error("call_failed rollout=%s error=%s", rollout.rollout_id, e)
            raise APIError(502, f"the model failed to answer: {e}", code="upstream_failed") from None
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


Shape = Callable[[dict[str, Any], ChatCompletionRequest], tuple[dict[str, Any], TokenRecord]]


def _passthrough_shape(
    resp: dict[str, Any], req: ChatCompletionRequest
) -> tuple[dict[str, Any], TokenRecord]:
    return client_response(resp, req), token_record(resp)


def _tito_shape(sent: list[int]) -> Shape:
    def shape(resp: dict[str, Any], req: ChatCompletionRequest) -> tuple[dict[str, Any], TokenRecord]:
        record = completion_token_record(resp)
        if record.prompt_ids != sent:
            raise BadUpstreamResponse("the engine reports prompt token ids other than those the gateway sent")
        return chat_from_completion(resp, req, record), record

    return shape


@dataclass(frozen=True)
class TitoTokenizer:
    """What tito needs of the served model: its tokenizer and end-of-turn token."""

    tokenizer: Tokenizer
    eos_id: int

    @classmethod
    def from_dir(cls, path: str, eos_token: str = "<|im_end|>") -> TitoTokenizer:
        """Load `tokenizer.json` from a model directory."""
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"tokenizer in {path} has no token {eos_token!r}")
        return cls(tok, eos)

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text` (special tokens such as <|im_start|> recognised, nothing added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


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
