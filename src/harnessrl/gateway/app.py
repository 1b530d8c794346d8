"""The gateway: an ASGI app with the model API (rollout keys) and the control API (admin key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from harnessrl.chat import ChatFormatError
from harnessrl.gateway import control, inference
from harnessrl.gateway.budget import ContextBudget
from harnessrl.gateway.canonical import ChatCall, Generation, Sampling, TokenRecord, effective_sampling
from harnessrl.gateway.errors import APIError, ErrorLog, validate
from harnessrl.gateway.faces import Face, ResponseIds, Streamer, completions
from harnessrl.gateway.faces.anthropic import AnthropicFace, CountTokensRequest, parse_request
from harnessrl.gateway.faces.models import model_card, model_list, wants_anthropic
from harnessrl.gateway.faces.openai_chat import OpenAIChatFace
from harnessrl.gateway.faces.responses import ResponsesFace
from harnessrl.gateway.history import History, RecentCalls
from harnessrl.gateway.http import FastJSONResponse, Handler, bearer, guarded, read_json
from harnessrl.gateway.inference import BadUpstreamResponse, TitoTokenizer
from harnessrl.gateway.keys import KeyRing, new_secret
from harnessrl.gateway.metrics import Metrics, count_request_notes
from harnessrl.gateway.openapi import openapi_document
from harnessrl.gateway.sglang import SGLangUpstream
from harnessrl.gateway.upstream import (
    StickyUpstream,
    Upstream,
    UpstreamClientError,
    UpstreamFailed,
    UpstreamPool,
)
from harnessrl.gateway.writer import CallWriter
from harnessrl.schema import Call, CallStatus, RewardIn, Rollout, now
from harnessrl.store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")


class GatewayConfig(BaseModel):
    """Settings of one gateway process."""

    admin_key: str = Field(min_length=8)
    upstream_url: str = "http://127.0.0.1:8100"
    replica_urls: list[str] = Field(
        default_factory=list
    )  # more replicas of the same model (sticky per rollout)
    served_model: str = "smollm2"
    model_map: dict[str, str] = Field(default_factory=dict)  # harness model name -> served model name
    default_max_tokens: int = 512
    pause_wait_s: float = 30.0  # how long a call waits for resume before getting 429
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0  # one try: the whole answer, or between two streamed pieces
    upstream_retries: int = 3
    stream_open_timeout_s: float = 30.0  # one streamed try: until the engine's headers (sent at once)
    call_timeout_s: float = 600.0  # every try of one call together, on all replicas (a pause can drain)
    mode: Literal["passthrough", "tito"] = "passthrough"
    tokenizer_path: str | None = None  # model directory with tokenizer.json; required for tito
    # wire of the upstream: "openai" = the engine protocol (builtin engine, vLLM's OpenAI server);
    # "sglang" = SGLang's native /generate (token IDs in and out; needs tito mode)
    upstream_kind: Literal["openai", "sglang"] = "openai"
    sglang_incremental_streaming: bool = False  # the SGLang server runs --incremental-streaming-output

    @model_validator(mode="after")
    def _sglang_needs_tito(self) -> GatewayConfig:
        if self.upstream_kind == "sglang" and self.mode != "tito":
            raise ValueError(
                "upstream_kind 'sglang' needs mode 'tito' (SGLang returns token IDs only from /generate)"
            )
        return self


class Gateway:
    """State shared by the handlers: store, keys, upstream, pause state and in-flight calls."""

    def __init__(self, config: GatewayConfig, store: Store, upstreams: list[Upstream] | None = None) -> None:
        self.config = config
        self.store = store
        self.keys = KeyRing(store.set_meta_if_absent("key_secret", new_secret()))
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
        if config.mode == "tito":
            if not config.tokenizer_path:
                raise ValueError("tito mode needs tokenizer_path (a model directory with tokenizer.json)")
            self.tito = TitoTokenizer.from_dir(config.tokenizer_path)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self._preemptible: set[asyncio.Task[Any]] = set()  # non-streaming engine calls a pause may cut
        self._preempted: set[asyncio.Task[Any]] = set()
        self.preempted_calls = 0
        self.recent = RecentCalls(store)
        self.writer = CallWriter(store)
        self._rollouts: dict[str, Rollout] = {}  # read-through cache; control writes call `forget`
        self.metrics = Metrics()
        self.budget = ContextBudget(self.tito)  # max_tokens vs the served model's context
        self.metrics.gauge(
            "harnessrl_gateway_paused", "1 while the gateway holds new calls.", lambda: float(self.paused)
        )
        self.metrics.gauge(
            "harnessrl_gateway_in_flight", "Model calls being served.", lambda: float(self.in_flight)
        )
        self._event_seq = asyncio.Condition()

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
        rollout = self._rollouts.get(rollout_id)
        if rollout is None:
            rollout = self.store.get_rollout(rollout_id)
            if rollout is not None:
                if len(self._rollouts) > 50_000:
                    self._rollouts.clear()
                self._rollouts[rollout_id] = rollout
        if rollout is None:
            raise APIError(401, "the rollout of this key does not exist in this gateway's store")
        if rollout.state.finished:
            raise APIError(409, f"rollout '{rollout_id}' is {rollout.state}; it accepts no more calls")
        return rollout

    # pause ----------------------------------------------------------------------------------------
    async def pause(self, drain_timeout_s: float, preempt: bool = False) -> bool:
        """Stop admitting calls and wait for in-flight ones; True if drained in time.

        With `preempt`, non-streaming calls still generating are cut instead of waited for: the engine
        aborts their sequences, and each is sent again, whole, once the gateway resumes (under the new
        weights, which its record then names). The harness sees one slower answer. Streaming calls, whose
        first bytes may be out already, are always waited for."""
        self._resumed.clear()
        if preempt:
            for task in list(self._preemptible):
                self._preempted.add(task)
                task.cancel()
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

    # model calls ----------------------------------------------------------------------------------
    async def model_call(self, request: Request, face: Face) -> Response:
        """One call on any chat face: validate, reach the engine, record the call, answer (or stream)."""
        rollout = self.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, self.config.max_body_bytes)
        req = face.parse(body)
        attempt = max(rollout.n_attempts - 1, 0)
        history = History(self.recent, rollout.rollout_id, attempt)
        chat = face.to_chat_call(req, history)
        notes = face.describe(req)  # ignored fields, dropped tools: recorded with the call and counted
        count_request_notes(self.metrics, face.name, notes)
        sampling = effective_sampling(chat, rollout.sampling, self.config.default_max_tokens)
        served = self.config.model_map.get(chat.model, self.config.served_model)
        ids = ResponseIds(uuid.uuid4().hex, int(time.time()))
        streamer = face.streamer(req, ids)
        await self._admit()
        handed_over = False
        try:
            call = self._new_call(rollout, attempt, served, body, sampling.temperature, face.name)
            t0 = time.perf_counter()
            up = StickyUpstream(self.upstreams, rollout.rollout_id)
            call.upstream = up.served_by
            param = "input" if face.name == "openai.responses" else "messages"
            fit = await self.budget.fit(up, served, chat, sampling, history.recent(), face.error_style, param)
            sampling = fit.sampling
            if fit.clamped is not None:
                notes["max_tokens_clamped"] = fit.clamped
                count_request_notes(self.metrics, face.name, {"max_tokens_clamped": fit.clamped})
            call.chat = {"messages": chat.messages, "tools": chat.tools, "answer": None, **notes}
            if streamer is None:
                gen = await self._preemptible_call(
                    lambda: self._engine(call, up, served, chat, sampling, history, t0), request, call, t0
                )
                out = face.render(gen, req, ids)
                await self._record_ok(call.model_copy(update={"upstream": up.served_by}), gen.record, out, t0,
                                      _chat_record(chat, gen))  # fmt: skip
                return FastJSONResponse(out)
            if self.tito is None:
                opening = inference.passthrough_stream(up, served, chat, sampling)
            else:
                opening = inference.tito_stream(up, served, chat, sampling, self.tito, history.recent())
            stream = await self._guard(call, t0, opening)  # failures before the first byte: a clear status
            handed_over = True
            relay = self._relay(stream, streamer, face, req, ids, call, up, chat, t0)
            return StreamingResponse(relay, media_type="text/event-stream", headers=SSE_HEADERS)
        finally:
            if not handed_over:
                self._release()

    async def _relay(
        self,
        stream: inference.Streamed,
        streamer: Streamer,
        face: Face,
        req: Any,
        ids: ResponseIds,
        call: Call,
        up: StickyUpstream,
        chat: ChatCall,
        t0: float,
    ) -> AsyncIterator[str]:
        """Relay content as it comes; record the call, then send the closing events (so an answer a
        harness has seen complete is always in the store)."""
        recorded = False  # once a record is on its way to the store, a disconnect adds none
        try:
            for frame in streamer.start():
                yield frame
            gen: Generation | None = None
            async for item in stream:
                if isinstance(item, inference.ContentDelta):
                    for frame in streamer.delta(item.text):
                        yield frame
                else:
                    gen = item
            if gen is None:
                raise BadUpstreamResponse("the engine's stream ended without a result")
            out = face.render(gen, req, ids)
            recorded = True
            await self._record_ok(call.model_copy(update={"upstream": up.served_by}), gen.record, out, t0,
                                  _chat_record(chat, gen))  # fmt: skip
            for frame in streamer.end(gen, out):
                yield frame
        except (UpstreamFailed, BadUpstreamResponse) as e:
            recorded = True
            await self._record_failed(call, str(e), t0)
            self.count_error(502)
            for frame in streamer.error(f"the model failed to answer: {e}"):
                yield frame
        except APIError as e:  # the store refused the call (see CallWriter): the stream ends with why
            self.count_error(e.status)
            for frame in streamer.error(e.message):
                yield frame
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: keep what was generated
            if not recorded:
                latency = time.perf_counter() - t0
                self.writer.submit(inference.cut_short(call, stream.partial(), latency, stream.text, chat))
            raise
        finally:
            self._release()

    async def _preemptible_call(
        self, make: Callable[[], Awaitable[T]], request: Request, call: Call, t0: float
    ) -> T:
        """Await `make()` (a non-streamed call to the engine).

        If a preempting pause cuts it, wait for resume (not counted in flight, so the pause drains) and
        run it again. If the client hangs up first, cut it (the engine aborts the sequence when the
        gateway's connection to it closes: nobody would receive the answer), record the call as
        cancelled and answer 499."""
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            while True:
                task = asyncio.ensure_future(make())
                self._preemptible.add(task)
                try:
                    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not task.done():
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
                        await self._record_gone(call, t0)
                        raise APIError(
                            499, "the client closed the connection before the answer", code="client_closed"
                        )
                    return await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if task not in self._preempted or (current is not None and current.cancelling()):
                        raise  # the handler itself was cancelled (shutdown)
                finally:
                    if not task.done():  # the handler was cancelled while waiting
                        task.cancel()
                    self._preemptible.discard(task)
                    self._preempted.discard(task)
                self.preempted_calls += 1
                self._release()
                await self._resumed.wait()
                self.in_flight += 1
                self._idle.clear()
        finally:
            gone.cancel()

    async def _record_gone(self, call: Call, t0: float) -> None:
        """Record a non-streamed call whose client hung up before its answer (no tokens reached anyone)."""
        error = "cancelled: the client disconnected before the answer"
        await self.writer.write(call.model_copy(update={
            "latency_s": time.perf_counter() - t0, "status": CallStatus.CANCELLED,
            "finish_reason": "cancelled", "error": error,
        }))  # fmt: skip
        self.metrics.inc(
            "harnessrl_gateway_calls_total", "Model calls recorded.", face=call.face, status="cancelled"
        )
        log.info("event=call_cancelled rollout=%s reason=client_gone", call.rollout_id)

    async def _engine(
        self,
        call: Call,
        up: StickyUpstream,
        served: str,
        chat: ChatCall,
        sampling: Sampling,
        history: History,
        t0: float,
    ) -> Generation:
        if self.tito is None:
            return await self._guard(call, t0, inference.passthrough(up, served, chat, sampling))
        return await self._guard(
            call, t0, inference.tito(up, served, chat, sampling, self.tito, history.recent())
        )

    async def _guard(self, call: Call, t0: float, work: Awaitable[T]) -> T:
        """Await the engine; client errors become 400s, failures a recorded failed call and a 502."""
        try:
            return await work
        except ChatFormatError as e:
            raise APIError(400, str(e)) from None
        except UpstreamClientError as e:
            raise APIError(400, f"the model rejected the request: {e.message}") from None
        except (UpstreamFailed, BadUpstreamResponse) as e:
            await self._record_failed(call, str(e), t0)
            raise APIError(502, f"the model failed to answer: {e}", code="upstream_failed") from None

    async def completion(self, request: Request) -> Response:
        """`POST /v1/completions`: a text or token-ID prompt, sent to the engine as is."""
        rollout = self.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, self.config.max_body_bytes)
        req = completions.parse(body)
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        shape = ChatCall(req.model, [], max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                         seed=req.seed, stop=stop)  # fmt: skip
        sampling = effective_sampling(shape, rollout.sampling, self.config.default_max_tokens)
        served = self.config.model_map.get(req.model, self.config.served_model)
        attempt = max(rollout.n_attempts - 1, 0)
        await self._admit()
        handed_over = False
        try:
            call = self._new_call(rollout, attempt, served, body, sampling.temperature, "openai.completions")
            t0 = time.perf_counter()
            up = StickyUpstream(self.upstreams, rollout.rollout_id)
            call.upstream = up.served_by
            if req.stream:
                engine_body = inference.raw_completion_body(served, req.prompt, sampling, req.logprobs or 0)
                events = await self._guard(call, t0, up.open_stream("/v1/completions", engine_body))
                handed_over = True
                relay = self._relay_completion(events, req, call, up, t0)
                return StreamingResponse(relay, media_type="text/event-stream", headers=SSE_HEADERS)
            resp, record = await self._preemptible_call(
                lambda: self._guard(
                    call, t0, inference.raw_completion(up, served, req.prompt, sampling, req.logprobs or 0)
                ),
                request,
                call,
                t0,
            )
            out = completions.client_response(resp, req)
            await self._record_ok(call.model_copy(update={"upstream": up.served_by}), record, out, t0, None)
            return JSONResponse(out)
        finally:
            if not handed_over:
                self._release()

    async def _relay_completion(
        self,
        events: AsyncIterator[dict[str, Any]],
        req: completions.CompletionRequest,
        call: Call,
        up: StickyUpstream,
        t0: float,
    ) -> AsyncIterator[str]:
        """Relay a streamed completion chunk by chunk; the chunk with the finish reason waits for the commit."""
        acc = inference.RawCompletionStream()
        held: list[dict[str, Any]] = []
        recorded = False  # once a record is on its way to the store, a disconnect adds none
        try:
            async for event in events:
                choice = acc.take(event)
                chunk = completions.client_chunk(event, req)
                if choice.get("finish_reason"):
                    held.append(chunk)
                else:
                    yield completions.sse(chunk)
            resp, record = acc.finish()
            out = completions.client_response(resp, req)
            recorded = True
            await self._record_ok(call.model_copy(update={"upstream": up.served_by}), record, out, t0, None)
            usage = completions.usage_chunk(resp, req)
            for chunk in held + ([usage] if usage else []):
                yield completions.sse(chunk)
            yield "data: [DONE]\n\n"
        except (UpstreamFailed, BadUpstreamResponse) as e:
            recorded = True
            await self._record_failed(call, str(e), t0)
            self.count_error(502)
            error = {"error": {"message": f"the model failed to answer: {e}", "type": "server_error",
                               "param": None, "code": "upstream_failed"}}  # fmt: skip
            yield completions.sse(error)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: keep what was generated
            if not recorded:
                latency = time.perf_counter() - t0
                self.writer.submit(inference.cut_short(call, acc.partial(), latency, acc.text, None))
            raise
        finally:
            self._release()

    def _new_call(
        self, rollout: Rollout, attempt: int, served: str, body: Any, temperature: float, face: str
    ) -> Call:
        return Call(
            call_id="call" + uuid.uuid4().hex,
            rollout_id=rollout.rollout_id,
            attempt=attempt,
            created_at=now(),
            latency_s=0.0,
            status=CallStatus.FAILED,
            model=served,
            upstream="",
            request=body if isinstance(body, dict) else {"body": body},
            temperature=temperature,
            face=face,
        )

    async def _record_failed(self, call: Call, error: str, t0: float) -> None:
        await self.writer.write(
            call.model_copy(update={"latency_s": time.perf_counter() - t0, "error": error})
        )
        self.metrics.inc(
            "harnessrl_gateway_calls_total", "Model calls recorded.", face=call.face, status="failed"
        )
        log.error("call_failed rollout=%s error=%s", call.rollout_id, error)

    async def _record_ok(
        self, call: Call, record: TokenRecord, out: dict[str, Any], t0: float, chat: dict[str, Any] | None
    ) -> None:
        version = record.weight_version if record.weight_version is not None else self.weight_version
        done = call.model_copy(
            update={
                "latency_s": time.perf_counter() - t0,
                "status": CallStatus.OK,
                "response": out,
                "prompt_ids": record.prompt_ids,
                "completion_ids": record.completion_ids,
                "completion_logprobs": record.completion_logprobs,
                "weight_version": version,
                "finish_reason": record.finish_reason,
                "chat": call.chat if chat is None else {**(call.chat or {}), **chat},
            }
        )
        self.recent.add(await self.writer.write(done))  # committed before the harness sees the answer
        m = self.metrics
        m.inc("harnessrl_gateway_calls_total", "Model calls recorded.", face=call.face, status="ok")
        m.inc(
            "harnessrl_gateway_prompt_tokens_total",
            "Prompt tokens of recorded calls.",
            len(record.prompt_ids),
        )
        m.inc("harnessrl_gateway_completion_tokens_total", "Completion tokens of recorded calls.",
              len(record.completion_ids))  # fmt: skip
        m.observe_latency(done.latency_s, face=call.face)

    async def count_tokens(self, request: Request) -> Response:
        """`POST /v1/messages/count_tokens`: the prompt's tokens as the served model sees them."""
        rollout = self.rollout_for(request, request.path_params.get("rollout_id"))
        req = parse_request(await read_json(request, self.config.max_body_bytes), CountTokensRequest)
        history = History(self.recent, rollout.rollout_id, max(rollout.n_attempts - 1, 0))
        chat = AnthropicFace().to_chat_call(req, history)
        served = self.config.model_map.get(chat.model, self.config.served_model)
        up = StickyUpstream(self.upstreams, rollout.rollout_id)
        n = await self.budget.count(up, served, chat, history.recent())
        if n is None:
            raise APIError(502, "the engine could not count the prompt's tokens", code="upstream_failed")
        return JSONResponse({"input_tokens": n})

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout from the cache after the control API changed it."""
        self._rollouts.pop(rollout_id, None)

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


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _until_disconnect(request: Request) -> None:
    """Return once the client has hung up: with the body read, the server's next ASGI message for the
    request is `http.disconnect` (sent when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _chat_record(chat: ChatCall, gen: Generation) -> dict[str, Any]:
    """The conversation of a call in canonical form, as stored in `Call.chat`."""
    record: dict[str, Any] = {"messages": chat.messages, "tools": chat.tools, "answer": gen.answer_message()}
    if gen.stopped_by is not None:
        record["stopped_by"] = gen.stopped_by  # the tokens hold text the harness never got
    return record


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
            return await gw().model_call(request, face)

        return counted(handle, face.error_style)

    async def completion(request: Request) -> Response:
        return await gw().completion(request)

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
        return await gw().count_tokens(request)

    async def self_reward(request: Request) -> Response:
        g = gw()
        rollout = g.rollout_for(request, request.path_params.get("rollout_id"))
        if rollout.metadata.get("allow_self_reward") is not True:
            raise APIError(403, "this rollout's task does not let the harness write its reward")
        value = validate(RewardIn, await read_json(request, g.config.max_body_bytes))
        stored = g.store.set_reward(rollout.rollout_id, value)
        return JSONResponse(stored.model_dump(mode="json"))

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
            holder["gw"].writer.close()

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
