"""Recording model calls: a `Call` is opened when a call is admitted and written once, with its
outcome — ok (committed before the harness sees the answer), failed, or cancelled by a client that
went away — and counted in the gateway's metrics."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from harnessrl.gateway.canonical import ChatCall, Generation, TokenRecord
from harnessrl.gateway.engine_client import inference
from harnessrl.gateway.history import RecentCalls
from harnessrl.gateway.metrics import Metrics
from harnessrl.gateway.writer import CallWriter
from harnessrl.schema import Call, CallStatus, Rollout, now
from harnessrl.store import Store

log = logging.getLogger(__name__)

_CALLS = ("harnessrl_gateway_calls_total", "Model calls recorded.")


def new_call_id() -> str:
    """`call` + 16 hex digits of the wall clock in ns + 16 random ones: unique, and in time order, so
    the store's index of call ids grows at its end. Random ids put each call's entry on a random
    page of that index: once a store holds some 200,000 calls, every commit dirtied a page of its
    own that the WAL fold then had to copy, and the gateway's p99 at one client grew 2.2 -> 8.2 ms
    and its c=64 throughput fell by a fifth (issue 35, docs/benchmarks.md)."""
    return f"call{time.time_ns() & 0xFFFFFFFFFFFFFFFF:016x}{os.urandom(8).hex()}"


class CallRecorder:
    """Writes the gateway's call records (through one `CallWriter`) and keeps the recent ones."""

    def __init__(
        self, store: Store, metrics: Metrics, weight_version: Callable[[], int | None], remember: bool = True
    ) -> None:
        self.writer = CallWriter(store)
        # remember=False: nothing kept in memory (a store other gateways write too)
        self.recent = RecentCalls(store) if remember else RecentCalls(store, max_rollouts=0)
        self.metrics = metrics
        self._weight_version = weight_version  # the version last announced by resume

    def open(
        self,
        rollout: Rollout,
        attempt: int,
        served: str,
        body: Any,
        temperature: float,
        face: str,
        policy: str | None = None,
    ) -> Call:
        """A new call of `rollout` (served by `policy`'s adapter, with several policies); `failed` until
        an outcome is recorded."""
        return Call(
            call_id=new_call_id(),
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
            policy=policy,
        )

    async def ok(
        self,
        call: Call,
        record: TokenRecord,
        out: dict[str, Any],
        t0: float,
        chat: dict[str, Any] | None,
        upstream: str | None = None,
    ) -> None:
        """Commit an answered call (before the answer is sent) with its exact tokens; `upstream`: the
        engine that answered, when a failover moved it from the one `call` names."""
        version = record.weight_version if record.weight_version is not None else self._weight_version()
        done = call.model_copy(
            update={
                "upstream": call.upstream if upstream is None else upstream,
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
        m.inc(*_CALLS, face=call.face, status="ok")
        m.inc(
            "harnessrl_gateway_prompt_tokens_total",
            "Prompt tokens of recorded calls.",
            len(record.prompt_ids),
        )
        m.inc("harnessrl_gateway_completion_tokens_total", "Completion tokens of recorded calls.",
              len(record.completion_ids))  # fmt: skip
        m.observe_latency(done.latency_s, face=call.face)

    async def failed(self, call: Call, error: str, t0: float) -> None:
        """Commit a call the engine failed to answer."""
        await self.writer.write(
            call.model_copy(update={"latency_s": time.perf_counter() - t0, "error": error})
        )
        self.metrics.inc(*_CALLS, face=call.face, status="failed")
        log.error("event=call_failed rollout=%s error=%s", call.rollout_id, error)

    async def gone(self, call: Call, t0: float) -> None:
        """Commit a non-streamed call whose client hung up before its answer (no tokens reached anyone)."""
        await self.writer.write(call.model_copy(update={
            "latency_s": time.perf_counter() - t0, "status": CallStatus.CANCELLED,
            "finish_reason": "cancelled", "error": "cancelled: the client disconnected before the answer",
            "weight_version": self._weight_version(),  # the version serving when it was cut
        }))  # fmt: skip
        self.metrics.inc(*_CALLS, face=call.face, status="cancelled")
        log.info("event=call_cancelled rollout=%s reason=client_gone", call.rollout_id)

    def cut_short(self, call: Call, record: TokenRecord, text: str, chat: ChatCall | None, t0: float) -> None:
        """Record (without waiting) a streamed call whose client went away: what was generated until then."""
        self.writer.submit(inference.cut_short(call, record, time.perf_counter() - t0, text, chat))
        self.metrics.inc(*_CALLS, face=call.face, status="cancelled")

    def close(self) -> None:
        """Flush and stop the writer."""
        self.writer.close()


def chat_record(chat: ChatCall, gen: Generation) -> dict[str, Any]:
    """The conversation of a call in canonical form, as stored in `Call.chat`."""
    record: dict[str, Any] = {"messages": chat.messages, "tools": chat.tools, "answer": gen.answer_message()}
    if gen.stopped_by is not None:
        record["stopped_by"] = gen.stopped_by  # the tokens hold text the harness never got
    return record
