"""HTTP handlers of the engine protocol: thin wrappers that parse, call the engine, and shape replies.

Every request problem becomes a 400 in OpenAI's error shape naming the field; nothing a client sends
can produce a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from harnessrl.chat import ChatFormatError
from harnessrl.engine.core import Engine, EngineError
from harnessrl.engine.protocol import (
    DetokenizeRequest,
    EngineChatCompletionRequest,
    EngineCompletionRequest,
    LoadWeightsRequest,
    TokenizeRequest,
    chat_response,
    completion_response,
    error_body,
)
from harnessrl.engine.sampling import SamplingParams
from harnessrl.engine.sequence import GenerationResult
from harnessrl.engine.state import InvalidEngineTransition
from harnessrl.engine.streaming import chat_events, completion_events
from harnessrl.modeling.weight_stream import MEDIA_TYPE as WEIGHTS_MEDIA_TYPE

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]
DISCONNECT_POLL_S = 0.25


async def _parse(request: Request, model: type[M]) -> M:
    """Read the JSON body into `model`; any problem becomes an EngineError naming the field."""
    try:
        data = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EngineError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise EngineError(f"{param}: {err['msg']}" if param else err["msg"], param) from exc


def _guard(fn: Handler) -> Handler:
    """Turn request errors into OpenAI-shaped 400s and anything unexpected into a logged 500."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except EngineError as exc:
            return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=400)
        except InvalidEngineTransition as exc:  # e.g. EngineAsleep: a weight load while asleep at level 2
            return JSONResponse(error_body(str(exc), code=exc.code), status_code=409)
        except ChatFormatError as exc:
            return JSONResponse(error_body(str(exc), "messages"), status_code=400)
        except Exception as exc:
            log.exception("event=request_failed path=%s", request.url.path)
            return JSONResponse(error_body(f"internal error: {exc}", kind="server_error"), status_code=500)

    return wrapped


def _check_common(req: EngineCompletionRequest | EngineChatCompletionRequest) -> None:
    if req.n not in (None, 1):
        raise EngineError("only n=1 is supported; send one request per sample", "n")


def _sampling(
    req: EngineCompletionRequest | EngineChatCompletionRequest,
    max_tokens: int,
    top_logprobs: int,
    adapter: str | None = None,
) -> SamplingParams:
    return SamplingParams(
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        top_logprobs=top_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def _completion_prompt(engine: Engine, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    if isinstance(prompt, str):
        return engine.encode(prompt)
    if prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise EngineError("batched prompts are not supported; send one prompt per request", "prompt")
        one = prompt[0]
        return engine.encode(one) if isinstance(one, str) else list(one)
    return [int(t) for t in prompt]  # type: ignore[arg-type]


async def _generate(
    request: Request, engine: Engine, prompt_ids: list[int], params: SamplingParams
) -> GenerationResult:
    """Generate; if the client disconnects first, abort the sequence so it stops using the engine."""
    task = asyncio.ensure_future(engine.generate(prompt_ids, params))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            log.info("event=client_disconnected path=%s", request.url.path)
            return GenerationResult(prompt_ids, [], [], [], "", "abort", None, engine.weight_version, 0)


def _aborted() -> JSONResponse:
    return JSONResponse(error_body("the engine is shutting down", kind="server_error"), status_code=503)


class EngineRoutes:
    """The engine's routes, one method each; `routes()` wraps them with the error guard."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.served_model_name

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        engine = self.engine
        req = await _parse(request, EngineCompletionRequest)
        _check_common(req)
        if req.echo:
            raise EngineError("echo=true is not supported by the builtin engine", "echo")
        prompt_ids = _completion_prompt(engine, req.prompt)
        max_tokens = engine.check_length(len(prompt_ids), req.max_tokens)
        params = _sampling(req, max_tokens, req.logprobs or 0, engine.adapter_for(req.model))
        if req.stream:
            events = completion_events(engine, prompt_ids, params, self.name, req.logprobs is not None)
            return StreamingResponse(events, media_type="text/event-stream")
        result = await _generate(request, engine, prompt_ids, params)
        if result.finish_reason == "abort":
            return _aborted()
        return JSONResponse(completion_response(result, self.name, engine.text, req))

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        engine = self.engine
        req = await _parse(request, EngineChatCompletionRequest)
        _check_common(req)
        tools = None if req.tool_choice == "none" else req.tools
        prompt_ids = engine.chat_prompt_ids(req.messages, tools, True, req.chat_template_kwargs)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = engine.check_length(len(prompt_ids), req.max_completion_tokens or req.max_tokens, param)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = _sampling(req, max_tokens, top, engine.adapter_for(req.model))
        chat = engine.chat.for_request(req.chat_template_kwargs)  # did this prompt open the thinking block?
        if req.stream:
            events = chat_events(engine, prompt_ids, params, self.name, bool(req.logprobs), req.tools, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        result = await _generate(request, engine, prompt_ids, params)
        if result.finish_reason == "abort":
            return _aborted()
        return JSONResponse(chat_response(result, self.name, engine.text, req, chat))

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: text or chat messages (+ tools) to the exact prompt ids."""
        req = await _parse(request, TokenizeRequest)
        if req.messages is not None:
            tokens = self.engine.chat_prompt_ids(
                req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs
            )
        elif req.prompt is not None:
            tokens = self.engine.encode(req.prompt)
        else:
            raise EngineError("send either 'prompt' (text) or 'messages'", "prompt")
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}
        )

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize."""
        req = await _parse(request, DetokenizeRequest)
        return JSONResponse({"prompt": self.engine.text.decode(req.tokens, skip_special_tokens=False)})

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the base model, then every LoRA adapter served per request."""
        card: dict[str, Any] = {"id": self.name, "object": "model", "owned_by": "harnessrl"}
        card.update(root=str(self.engine.model_dir), max_model_len=self.engine.max_model_len)
        served = self.engine.adapters.served() if self.engine.adapters is not None else {}
        adapters = [  # vLLM's shape for a LoRA adapter: its name, on the base model as `parent`
            {"id": name, "object": "model", "owned_by": "harnessrl", "parent": self.name, "version": version,
             "max_model_len": self.engine.max_model_len}
            for name, version in sorted(served.items())
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def health(self, request: Request) -> Response:
        """GET /health."""
        return JSONResponse({"status": "ok", "weight_version": self.engine.weight_version})

    async def pause(self, request: Request) -> Response:
        """POST /admin/pause: stop admitting new sequences (running ones finish)."""
        self.engine.pause()
        return JSONResponse({"paused": True, "running": self.engine.stats()["running"]})

    async def resume(self, request: Request) -> Response:
        """POST /admin/resume."""
        self.engine.resume()
        return JSONResponse({"paused": False})

    async def load_weights(self, request: Request) -> Response:
        """POST /admin/load_weights: returns after the swap, with the new version. A JSON body names a
        folder (`path`); a body of type `application/vnd.safetensors` is the weights themselves, with
        `?version=N` (`_load_weights_body`)."""
        if request.headers.get("content-type", "").split(";")[0].strip() == WEIGHTS_MEDIA_TYPE:
            return await self._load_weights_body(request)
        req = await _parse(request, LoadWeightsRequest)
        if (req.path is None) == (req.shm is None):
            raise EngineError(
                "send either 'path' (a folder or file) or 'shm' (a shared-memory segment)", "path"
            )
        if req.shm is not None:
            if req.adapter is not None:
                raise EngineError("an adapter is loaded from a folder ('path'), not from 'shm'", "shm")
            return JSONResponse(
                {"weight_version": await self.engine.load_weights_shared(req.shm, req.version)}
            )
        assert req.path is not None
        try:
            version = await self.engine.load_weights(req.path, req.version, req.adapter)
        except (ValueError, OSError) as exc:  # an adapter that does not fit this model, or unreadable
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"cannot load adapter {req.adapter!r} from {req.path}: {exc}", "path") from exc
        return JSONResponse({"weight_version": version})

    async def _load_weights_body(self, request: Request) -> Response:
        """The trainer's memory sync: the body is a safetensors stream, received chunk by chunk
        (`Engine.load_weights_stream`); a body that is not what its header says is refused whole."""
        raw = request.query_params.get("version", "")
        if not raw.isdigit():
            raise EngineError(
                f"version: send the weight version as ?version=N (an integer), not {raw!r}", "version"
            )
        length = request.headers.get("content-length")
        try:
            version = await self.engine.load_weights_stream(
                request.stream(), int(raw), int(length) if length and length.isdigit() else None
            )
        except ClientDisconnect as exc:
            raise EngineError("the weights body was cut off (client disconnected)", "body") from exc
        return JSONResponse({"weight_version": version})

    async def weight_version(self, request: Request) -> Response:
        """GET /admin/weight_version."""
        return JSONResponse({"weight_version": self.engine.weight_version})

    async def sleep(self, request: Request) -> Response:
        """POST /admin/sleep?level=1|2 (as vLLM's /sleep): after running sequences finish, level 1 frees
        the KV cache and moves weights off the accelerator; level 2 also discards the weights, so the
        next weight load (after wake-up) must come before requests are served."""
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise EngineError(f"level must be 1 or 2, not {raw!r}", "level")
        state = await self.engine.sleep(int(raw))  # asleep at level 2 already: a level-1 request keeps it
        return JSONResponse({"sleeping": state.sleeping, "level": state.sleep_level})

    async def wake_up(self, request: Request) -> Response:
        """POST /admin/wake_up: weights back on the device (or allocated, level 2) and the KV cache."""
        state = await self.engine.wake_up()
        return JSONResponse({"sleeping": state.sleeping})

    async def stats(self, request: Request) -> Response:
        """GET /admin/stats: scheduler counters (max batch seen, tokens, queue sizes), `paused`, the
        memory state (`engine_state`) and the flags derived from it (`sleeping`, `sleep_level`,
        `needs_weights`)."""
        return JSONResponse(self.engine.stats())

    def routes(self) -> list[Route]:
        """All routes, each behind the error guard."""
        table: list[tuple[str, Handler, str]] = [
            ("/v1/completions", self.completions, "POST"),
            ("/v1/chat/completions", self.chat, "POST"),
            ("/tokenize", self.tokenize, "POST"),
            ("/detokenize", self.detokenize, "POST"),
            ("/v1/models", self.models, "GET"),
            ("/health", self.health, "GET"),
            ("/admin/pause", self.pause, "POST"),
            ("/admin/resume", self.resume, "POST"),
            ("/admin/load_weights", self.load_weights, "POST"),
            ("/admin/weight_version", self.weight_version, "GET"),
            ("/admin/stats", self.stats, "GET"),
            ("/admin/sleep", self.sleep, "POST"),
            ("/admin/wake_up", self.wake_up, "POST"),
        ]
        return [Route(path, _guard(fn), methods=[method]) for path, fn, method in table]


class RequireKey:
    """ASGI middleware: every HTTP request but `GET /health` must carry `Authorization: Bearer <key>`
    (401 otherwise), so a process that finds the engine's port cannot generate, load weights or pause."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body(
                    "missing or wrong engine key (Authorization: Bearer ...)", code="invalid_api_key"
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Engine, api_key: str | None = None) -> Starlette:
    """The Starlette app serving `engine`; its lifespan starts and stops the scheduler thread. With
    `api_key`, every route but /health requires it (`RequireKey`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    middleware = [Middleware(RequireKey, key=api_key)] if api_key else []
    return Starlette(routes=EngineRoutes(engine).routes(), lifespan=lifespan, middleware=middleware)
