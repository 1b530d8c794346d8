"""A run's rollouts as OpenTelemetry traces (OTLP/JSON), following the GenAI semantic conventions.

One trace per rollout: a root `invoke_agent` span for the rollout (its task, group, state, reward),
a child span per attempt (the harness run: status, exit code), and under each attempt one `chat` span
per model call, kind CLIENT, with the `gen_ai.*` attributes of the conventions (operation, provider,
request and response model, sampling parameters, finish reasons, token usage, input and output
messages with their tool calls, tool definitions) and harnessrl's own (`harnessrl.*`): the prompt and
completion token ids, the completion logprobs, the weight version, the row the call went into and the
merge break it caused. Ids are derived from the rollout and call ids, so exporting twice gives the
same traces.

The document is an `ExportTraceServiceRequest` in the OTLP/JSON encoding (trace and span ids as hex,
64-bit integers as strings); `post_otlp` sends it to a collector's OTLP/HTTP endpoint in batches.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from harnessrl.chat import tool_call_parts
from harnessrl.inspection.report import row_positions
from harnessrl.inspection.runview import RunSettings, rollout_place, rollout_rows
from harnessrl.schema import AttemptStatus, Call, CallStatus, RolloutDetail, RolloutState

SCOPE = "harnessrl.export"
KIND_INTERNAL, KIND_CLIENT = 1, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
# the conventions' finish reasons of an output message, for the API names that differ
FINISH_REASONS = {"tool_calls": "tool_call", "function_call": "tool_call", "end_turn": "stop",
                  "max_tokens": "length", "tool_use": "tool_call", "stop_sequence": "stop"}  # fmt: skip


def _id(text: str, nbytes: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[: 2 * nbytes]


def trace_id(rollout_id: str) -> str:
    """The 16-byte trace id (hex) of a rollout's trace."""
    return _id(f"trace:{rollout_id}", 16)


def span_id(key: str) -> str:
    """An 8-byte span id (hex) for a rollout, attempt or call key."""
    return _id(f"span:{key}", 8)


def _nanos(t: float) -> str:
    return str(round(t * 1e9))


def _value(v: Any) -> dict[str, Any]:
    """An OTLP AnyValue (arrays of scalars; anything else as a JSON string)."""
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, list | tuple) and all(isinstance(x, str | int | float) for x in v):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": json.dumps(v, ensure_ascii=False)}


def _attrs(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in values.items() if v is not None]


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}] if content else []
    if isinstance(content, list):
        return [{"type": "text", "content": p.get("text", "")} for p in content
                if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")]  # fmt: skip
    return []


def semconv_message(msg: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A chat message in the GenAI conventions' message form (role, parts: text, tool_call,
    tool_call_response)."""
    role = str(msg.get("role", "user"))
    if role == "tool":
        parts: list[dict[str, Any]] = [
            {"type": "tool_call_response", "id": msg.get("tool_call_id"), "response": msg.get("content")}
        ]
    else:
        parts = _parts(msg.get("content"))
        for call_id, name, args in tool_call_parts(msg.get("tool_calls")):
            parts.append({"type": "tool_call", "id": call_id, "name": name, "arguments": args})
    out: dict[str, Any] = {"role": role, "parts": parts}
    if finish_reason is not None:
        out["finish_reason"] = FINISH_REASONS.get(finish_reason, finish_reason)
    return out


def _provider(face: str) -> str:
    return "anthropic" if face.startswith("anthropic") else "openai"


def _operation(face: str) -> str:
    return "text_completion" if face == "openai.completions" else "chat"


def call_span(call: Call, parent: str, row: int | None, cause: str | None) -> dict[str, Any]:
    """The span of one model call (GenAI `chat` client span with token ids)."""
    messages, tools, answer = call.conversation()
    req = call.request
    op = _operation(call.face)
    model = req.get("model") if isinstance(req.get("model"), str) else call.model
    failed = call.status != CallStatus.OK
    attrs = {
        "gen_ai.operation.name": op,
        "gen_ai.provider.name": _provider(call.face),
        "gen_ai.request.model": model,
        "gen_ai.response.model": call.model or None,
        "gen_ai.response.id": call.call_id,
        "gen_ai.conversation.id": call.rollout_id,
        "gen_ai.request.temperature": _num(req.get("temperature")),
        "gen_ai.request.top_p": _num(req.get("top_p")),
        "gen_ai.request.max_tokens": _int(req.get("max_tokens", req.get("max_completion_tokens"))),
        "gen_ai.request.seed": _int(req.get("seed")),
        "gen_ai.response.finish_reasons": [call.finish_reason] if call.finish_reason else None,
        "gen_ai.usage.input_tokens": len(call.prompt_ids),
        "gen_ai.usage.output_tokens": len(call.completion_ids),
        "gen_ai.input.messages": [semconv_message(m) for m in messages if isinstance(m, dict)] or None,
        "gen_ai.output.messages": [semconv_message(answer, call.finish_reason)] if answer else None,
        "gen_ai.tool.definitions": tools or None,
        "error.type": str(call.status) if failed else None,
        "harnessrl.call.index": call.index,
        "harnessrl.call.status": str(call.status),
        "harnessrl.attempt": call.attempt,
        "harnessrl.face": call.face,
        "harnessrl.upstream": call.upstream or None,
        "harnessrl.weight_version": call.weight_version,
        "harnessrl.policy": call.policy,
        "harnessrl.sampling_temperature": call.temperature,
        "harnessrl.prompt_token_ids": call.prompt_ids,
        "harnessrl.completion_token_ids": call.completion_ids,
        "harnessrl.completion_logprobs": call.completion_logprobs,
        "harnessrl.row": row,
        "harnessrl.break_cause": cause,
    }
    status = (
        {"code": STATUS_ERROR, "message": call.error or str(call.status)}
        if failed
        else {"code": STATUS_UNSET}
    )
    return {
        "traceId": trace_id(call.rollout_id),
        "spanId": span_id(f"call:{call.call_id}"),
        "parentSpanId": parent,
        "name": f"{op} {model}".strip(),
        "kind": KIND_CLIENT,
        "startTimeUnixNano": _nanos(call.created_at),
        "endTimeUnixNano": _nanos(call.created_at + max(call.latency_s, 0.0)),
        "attributes": _attrs(attrs),
        "status": status,
    }


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def rollout_spans(
    d: RolloutDetail, settings: RunSettings, agent: str | None, advantage: float | None = None
) -> list[dict[str, Any]]:
    """The spans of one rollout's trace: the rollout, its attempts, its calls."""
    r = d.rollout
    place = rollout_place(r)
    tid, root = trace_id(r.rollout_id), span_id(f"rollout:{r.rollout_id}")
    row_of, cause_of = row_positions(rollout_rows(d, settings))
    end = max([r.updated_at, *(c.created_at + c.latency_s for c in d.calls)])
    root_attrs = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": agent,
        "gen_ai.conversation.id": r.rollout_id,
        "harnessrl.rollout_id": r.rollout_id,
        "harnessrl.client_id": r.client_id,
        "harnessrl.task_id": r.task_id,
        "harnessrl.group_id": r.group_id,
        "harnessrl.state": str(r.state),
        "harnessrl.phase": place.phase,
        "harnessrl.step": place.step,
        "harnessrl.group_index": place.group,
        "harnessrl.eval_label": place.label or None,
        "harnessrl.attempts": r.n_attempts,
        "harnessrl.reward": d.reward.value if d.reward is not None else None,
        "harnessrl.reward_details": d.reward.details if d.reward is not None and d.reward.details else None,
        "harnessrl.advantage": advantage,
    }
    bad = r.state in (RolloutState.FAILED, RolloutState.CANCELLED)
    spans = [{
        "traceId": tid, "spanId": root, "name": f"invoke_agent {agent or r.task_id}", "kind": KIND_INTERNAL,
        "startTimeUnixNano": _nanos(r.created_at), "endTimeUnixNano": _nanos(end),
        "attributes": _attrs(root_attrs),
        "status": {"code": STATUS_ERROR, "message": str(r.state)} if bad else {"code": STATUS_UNSET},
    }]  # fmt: skip
    for a in d.attempts:
        aid = span_id(f"attempt:{r.rollout_id}:{a.attempt}")
        a_end = a.ended_at if a.ended_at is not None else end
        a_bad = a.status in (AttemptStatus.INFRA_ERROR, AttemptStatus.TIMEOUT)
        spans.append({
            "traceId": tid, "spanId": aid, "parentSpanId": root, "name": f"attempt {a.attempt}",
            "kind": KIND_INTERNAL, "startTimeUnixNano": _nanos(a.started_at), "endTimeUnixNano": _nanos(a_end),
            "attributes": _attrs({"harnessrl.attempt": a.attempt, "harnessrl.attempt.status": str(a.status),
                                  "harnessrl.attempt.exit_code": a.exit_code, "error.type": str(a.status) if a_bad else None}),
            "status": {"code": STATUS_ERROR, "message": a.error or str(a.status)} if a_bad else {"code": STATUS_UNSET},
        })  # fmt: skip
        for c in d.calls:
            if c.attempt == a.attempt:
                spans.append(call_span(c, aid, row_of.get(c.call_id), cause_of.get(c.call_id)))
    known = {a.attempt for a in d.attempts}
    spans.extend(call_span(c, root, row_of.get(c.call_id), cause_of.get(c.call_id))
                 for c in d.calls if c.attempt not in known)  # fmt: skip
    return spans


def otlp_document(spans: Iterable[dict[str, Any]], run_id: str | None, version: str) -> dict[str, Any]:
    """An OTLP/JSON `ExportTraceServiceRequest` holding `spans` under one resource (the run)."""
    resource = _attrs({"service.name": "harnessrl", "harnessrl.run_id": run_id})
    return {"resourceSpans": [{
        "resource": {"attributes": resource},
        "scopeSpans": [{"scope": {"name": SCOPE, "version": version}, "spans": list(spans)}],
    }]}  # fmt: skip


def batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    """`items` in lists of `n`."""
    chunk: list[Any] = []
    for x in items:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector endpoint (`/v1/traces` added unless given)."""
    e = endpoint.rstrip("/")
    return e if e.endswith("/v1/traces") else f"{e}/v1/traces"


class OTLPError(RuntimeError):
    """The collector refused or partly rejected the spans; the message holds its answer."""


def post_otlp(documents: Iterable[dict[str, Any]], endpoint: str, timeout_s: float = 30.0,
              headers: dict[str, str] | None = None) -> int:  # fmt: skip
    """POST each document to the collector (OTLP/HTTP, JSON encoding); returns the spans sent."""
    url, sent = traces_url(endpoint), 0
    with httpx.Client(timeout=timeout_s) as client:
        for doc in documents:
            n = sum(len(s["spans"]) for rs in doc["resourceSpans"] for s in rs["scopeSpans"])
            try:
                resp = client.post(
                    url,
                    content=json.dumps(doc),
                    headers={"Content-Type": "application/json", **(headers or {})},
                )
            except httpx.HTTPError as e:
                raise OTLPError(f"cannot reach the OTLP collector at {url}: {e}") from e
            if resp.status_code // 100 != 2:
                raise OTLPError(f"the OTLP collector at {url} answered {resp.status_code}: {resp.text[:500]}")
            partial = (resp.json() if resp.content else {}).get("partialSuccess") or {}
            if int(partial.get("rejectedSpans") or 0):
                raise OTLPError(f"the OTLP collector at {url} rejected {partial['rejectedSpans']} of {n} spans: "
                                f"{partial.get('errorMessage', '')}")  # fmt: skip
            sent += n
    return sent


def to_protobuf_json(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its hex trace/span ids as base64: the proto3 JSON mapping that protobuf's own
    parser reads (OTLP/JSON differs from it only there)."""

    def b64(hexid: str) -> str:
        return base64.b64encode(bytes.fromhex(hexid)).decode()

    out = json.loads(json.dumps(doc))
    for rs in out.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if span.get(k):
                        span[k] = b64(span[k])
    return out


def parse_with_proto(doc: dict[str, Any]) -> Any:
    """Parse `doc` with the OpenTelemetry protobuf definitions (package opentelemetry-proto): an
    `ExportTraceServiceRequest`; unknown fields or wrong types raise `json_format.ParseError`."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return json_format.ParseDict(to_protobuf_json(doc), ExportTraceServiceRequest())
