"""`harnessrl export / validate / import`: training rows (JSONL, Parquet) equal to what the adapter builds,
our versioned trace format and its JSON Schema, the round trip into a fresh store, and OpenTelemetry traces
checked by OpenTelemetry's own protobuf definitions and sent over OTLP/HTTP to a receiver on loopback.
The run is the real-tokenizer fixture of test_inspect, and one recorded by the real gateway and engine."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from harnessrl.cli import main as harnessrl
from harnessrl.config import RunConfig
from harnessrl.export import otlp, schemas
from harnessrl.export.writers import read_parquet_rows
from harnessrl.inspection import index_report, rollout_report
from harnessrl.store import SQLiteStore
from tests.support.gateway import GatewayHandle, ThreadServer
from tests.support.run_fixtures import Fixture

pytest.importorskip("pyarrow")


def _export(run_dir: Path, fmt: str, out: Path, *extra: str) -> None:
    assert harnessrl(["export", str(run_dir), "--format", fmt, "--out", str(out), *extra]) == 0


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_rows_are_the_adapters_rows_with_advantages_and_weights(fixture_run: Fixture, tmp_path: Path) -> None:
    _export(fixture_run.run_dir, "jsonl", tmp_path / "rows.jsonl")
    rows = _jsonl(tmp_path / "rows.jsonl")
    index = {r["rollout_id"]: r for r in index_report(fixture_run.run_dir)["rollouts"]}
    # training rollouts only (not the evaluation one), rows in step order
    assert [(r["step"], r["rollout_id"], r["row_index"]) for r in rows] == [
        (1, "roaaaa1111", 0), (1, "roaaaa1111", 1), (1, "roaaaa2222", 0), (1, "roaaaa2222", 1),
        (1, "robbbb3333", 0), (1, "robbbb3333", 1), (2, "rocccc4444", 0),
    ]  # fmt: skip
    for r in rows:
        assert r["advantage"] == pytest.approx(index[r["rollout_id"]]["advantage"])
        assert (
            r["reward"] == index[r["rollout_id"]]["reward"]
            and r["group_id"] == index[r["rollout_id"]]["group_id"]
        )
        assert len(r["input_ids"]) == len(r["loss_mask"]) == len(r["old_logprobs"]) == len(r["token_weights"])
        assert r["n_trainable"] == sum(r["loss_mask"]) > 0
        assert all(w == 0 for w, m in zip(r["token_weights"], r["loss_mask"], strict=True) if m == 0)
    for step in (1, 2):  # rollout-token-mean: each step's weights sum to 1, each rollout's to 1/R
        assert sum(sum(r["token_weights"]) for r in rows if r["step"] == step) == pytest.approx(1.0)
    assert sum(sum(r["token_weights"]) for r in rows if r["rollout_id"] == "roaaaa1111") == pytest.approx(
        1 / 3
    )
    shown = rollout_report(fixture_run.run_dir, "roaaaa1111")["rows"]
    mine = [r for r in rows if r["rollout_id"] == "roaaaa1111"]
    assert [(r["input_ids"], r["loss_mask"], r["old_logprobs"]) for r in mine] == [
        (s["tokens"], s["loss_mask"], s["logprobs"]) for s in shown
    ]
    assert [r["attempt"] for r in rows if r["rollout_id"] == "robbbb3333"] == [1, 1]  # the last attempt
    calls = fixture_run.calls["roaaaa1111"]
    assert mine[0]["call_ids"] == [calls[0].call_id, calls[1].call_id] and mine[1]["call_ids"] == [
        calls[2].call_id
    ]


def test_parquet_holds_the_same_records_with_typed_columns(fixture_run: Fixture, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    _export(fixture_run.run_dir, "jsonl", tmp_path / "rows.jsonl")
    _export(fixture_run.run_dir, "parquet", tmp_path / "rows.parquet")
    assert list(read_parquet_rows(tmp_path / "rows.parquet")) == _jsonl(tmp_path / "rows.jsonl")
    schema = pq.read_schema(tmp_path / "rows.parquet")
    assert str(schema.field("input_ids").type) == "list<element: int32>"
    assert str(schema.field("loss_mask").type) == "list<element: int8>"
    assert schema.metadata[b"harnessrl.rows_schema_version"] == b"1"


def test_committed_schemas_are_current() -> None:
    for name, schema in schemas.generated().items():
        committed = (schemas.SCHEMA_DIR / name).read_text()
        assert committed == schemas.dump(schema), f"run: python -m harnessrl.export.schemas ({name} is stale)"


def test_validate_accepts_every_export_and_names_what_is_wrong(
    fixture_run: Fixture, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {f: tmp_path / f"run.{f}" for f in ("parquet", "jsonl", "trace", "otlp-json")}
    for fmt, path in files.items():
        _export(fixture_run.run_dir, fmt, path)
    assert harnessrl(["validate", *map(str, files.values())]) == 0
    out = capsys.readouterr().out
    assert "valid rows-parquet (7 records)" in out and "valid rows-jsonl (7 records)" in out
    assert "valid trace (6 records)" in out and "valid otlp-json" in out

    def broken(name: str, fmt: str, edit: Callable[[list[dict[str, Any]]], None]) -> Path:
        records = _jsonl(files[fmt])
        edit(records)
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    cases = [
        (broken("a", "jsonl", lambda rs: rs[2].update(loss_mask="x")), ":3: loss_mask: 'x' is not of type 'array'"),
        (broken("b", "jsonl", lambda rs: rs[0].pop("advantage")), ":1: (record): 'advantage' is a required property"),
        (broken("c", "jsonl", lambda rs: rs[0].update(schema_version=2)), "rows schema version 2; this harnessrl reads version 1"),
        (broken("d", "trace", lambda rs: rs[2]["calls"][0].update(prompt_ids="?")), ":3: calls/0/prompt_ids"),
        (broken("e", "trace", lambda rs: rs.pop()), "the header announces 5 rollouts but 4 follow"),
        (broken("f", "trace", lambda rs: rs.insert(2, rs[0])), ":3: the header must be the first line"),
        (broken("g", "otlp-json", lambda rs: rs[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0].update(kind="sideways")), ":1: not an OTLP"),
        (broken("h", "otlp-json", lambda rs: rs[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][1].update(spanId="abcd")), "malformed trace/span id"),
    ]  # fmt: skip
    for path, message in cases:
        assert harnessrl(["validate", str(path)]) == 1, message
        err = capsys.readouterr().err
        assert "INVALID" in err and message in err and "Traceback" not in err, (message, err)
    (tmp_path / "x.txt").write_text("hello\n")
    assert harnessrl(["validate", str(tmp_path / "x.txt"), str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "not JSON" in err and "no file at" in err


def test_round_trip_into_a_fresh_store_gives_the_same_rows(fixture_run: Fixture, tmp_path: Path) -> None:
    run = fixture_run.run_dir
    _export(run, "trace", tmp_path / "a.trace")
    assert harnessrl(["import", str(tmp_path / "a.trace"), "--run-dir", str(tmp_path / "copy")]) == 0
    copy = tmp_path / "copy"
    _export(copy, "trace", tmp_path / "b.trace")
    assert (tmp_path / "a.trace").read_bytes() == (tmp_path / "b.trace").read_bytes()
    for fmt in ("jsonl", "parquet"):
        _export(run, fmt, tmp_path / f"a.{fmt}")
        _export(copy, fmt, tmp_path / f"b.{fmt}")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert list(read_parquet_rows(tmp_path / "a.parquet")) == list(read_parquet_rows(tmp_path / "b.parquet"))
    a, b = index_report(run), index_report(copy)
    assert a["rollouts"] == b["rollouts"] and a["steps"] == b["steps"]
    original, imported = SQLiteStore(run / "store.sqlite"), SQLiteStore(copy / "store.sqlite")
    try:
        for rid in fixture_run.calls:
            assert original.detail(rid) == imported.detail(rid)  # ids, times, indexes, rewards as stored
    finally:
        original.close()
        imported.close()


def test_import_refuses_what_would_lose_or_mix_data(
    fixture_run: Fixture, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _export(fixture_run.run_dir, "trace", tmp_path / "a.trace")
    assert harnessrl(["import", str(tmp_path / "a.trace"), "--run-dir", str(fixture_run.run_dir)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    lines = (tmp_path / "a.trace").read_text().splitlines()
    (tmp_path / "cut.trace").write_text("\n".join(lines[:3]) + "\n")
    assert harnessrl(["import", str(tmp_path / "cut.trace"), "--run-dir", str(tmp_path / "c1")]) == 2
    assert "announces 5 rollouts but 2 followed" in capsys.readouterr().err
    bad = json.loads(lines[1])
    bad["calls"][0]["completion_ids"] = "nope"
    (tmp_path / "bad.trace").write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    assert harnessrl(["import", str(tmp_path / "bad.trace"), "--run-dir", str(tmp_path / "c2")]) == 2
    assert "bad.trace:2: calls.0.completion_ids" in capsys.readouterr().err
    (tmp_path / "dup.trace").write_text("\n".join([lines[0], lines[1], lines[1]]) + "\n")
    assert harnessrl(["import", str(tmp_path / "dup.trace"), "--run-dir", str(tmp_path / "c3")]) == 2
    assert "is already stored" in capsys.readouterr().err


def _spans(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]


def _attr(span: dict[str, Any], key: str) -> Any:
    for a in span["attributes"]:
        if a["key"] == key:
            v = a["value"]
            if "arrayValue" in v:
                return [next(iter(x.values())) for x in v["arrayValue"]["values"]]
            return next(iter(v.values()))
    return None


def test_otlp_traces_follow_the_genai_conventions_and_parse_with_the_otel_protos(
    fixture_run: Fixture, tmp_path: Path
) -> None:
    pytest.importorskip("opentelemetry.proto")
    _export(fixture_run.run_dir, "otlp-json", tmp_path / "t.otlp.jsonl")
    (doc,) = _jsonl(tmp_path / "t.otlp.jsonl")
    req = otlp.parse_with_proto(doc)  # OpenTelemetry's own definitions: unknown fields or bad types fail
    proto_spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    spans = _spans(doc)
    assert len(proto_spans) == len(spans)
    assert {s.trace_id.hex() for s in proto_spans} == {
        otlp.trace_id(r) for r in fixture_run.calls
    }  # one per rollout
    calls = [s for s in spans if _attr(s, "gen_ai.operation.name") == "chat"]
    assert len(calls) == sum(len(c) for c in fixture_run.calls.values())
    by_call = {_attr(s, "gen_ai.response.id"): s for s in calls}
    by_id = {s["spanId"]: s for s in spans}
    for rid, stored in fixture_run.calls.items():
        for c in stored:
            span = by_call[c.call_id]
            assert span["kind"] == 3 and span["traceId"] == otlp.trace_id(rid)
            assert [int(x) for x in _attr(span, "harnessrl.prompt_token_ids")] == c.prompt_ids
            assert [int(x) for x in (_attr(span, "harnessrl.completion_token_ids") or [])] == c.completion_ids
            assert int(_attr(span, "gen_ai.usage.input_tokens")) == len(c.prompt_ids)
            attempt = by_id[span["parentSpanId"]]
            assert attempt["name"] == f"attempt {c.attempt}"
            assert _attr(by_id[attempt["parentSpanId"]], "gen_ai.operation.name") == "invoke_agent"
    first, _, third = fixture_run.calls["roaaaa1111"]
    out = json.loads(_attr(by_call[first.call_id], "gen_ai.output.messages"))
    assert out[0]["parts"][0] == {
        "type": "tool_call",
        "id": "c1",
        "name": "calc",
        "arguments": {"expression": "2+3"},
    }
    assert out[0]["finish_reason"] == "stop"
    assert _attr(by_call[third.call_id], "harnessrl.break_cause") == "history_edited"
    inputs = json.loads(_attr(by_call[fixture_run.calls["roaaaa1111"][1].call_id], "gen_ai.input.messages"))
    assert inputs[-1] == {
        "role": "tool",
        "parts": [{"type": "tool_call_response", "id": "c1", "response": "5"}],
    }
    failed = by_call[fixture_run.calls["rocccc4444"][0].call_id]
    assert (
        failed["status"] == {"code": 2, "message": "upstream 503"} and _attr(failed, "error.type") == "failed"
    )
    root = next(
        s for s in spans if _attr(s, "harnessrl.rollout_id") == "roaaaa1111" and "parentSpanId" not in s
    )
    assert _attr(root, "harnessrl.reward") == 1.0 and int(_attr(root, "harnessrl.step")) == 1
    again = tmp_path / "again.jsonl"
    _export(fixture_run.run_dir, "otlp-json", again)
    assert again.read_bytes() == (tmp_path / "t.otlp.jsonl").read_bytes()  # deterministic ids


class Receiver:
    """An OTLP/HTTP receiver on loopback: parses each JSON request with the OTel protos, like a collector."""

    def __init__(self, status: int = 200, answer: dict[str, Any] | None = None) -> None:
        self.requests: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.status, self.answer = status, answer or {}

    def app(self) -> Starlette:
        async def traces(request: Request) -> JSONResponse:
            if request.headers.get("content-type") != "application/json":
                return JSONResponse({"message": "unsupported content type"}, 415)
            self.requests.append(otlp.parse_with_proto(json.loads(await request.body())))
            self.headers.append(dict(request.headers))
            return JSONResponse(self.answer, self.status)

        return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def test_otlp_http_to_a_collector(
    fixture_run: Fixture, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("opentelemetry.proto")
    rx = Receiver()
    with ThreadServer(rx.app()) as srv:
        argv = ["export", str(fixture_run.run_dir), "--format", "otlp-json", "--otlp-endpoint", srv.url,
                "--otlp-header", "authorization=Bearer k1", "--out", str(tmp_path / "copy.jsonl")]  # fmt: skip
        assert harnessrl(argv) == 0
    spans = [s for req in rx.requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert (
        len(spans) == len(_spans(_jsonl(tmp_path / "copy.jsonl")[0]))
        and rx.headers[0]["authorization"] == "Bearer k1"
    )
    assert f"sent {len(spans)} spans to {srv.url}/v1/traces" in capsys.readouterr().out
    for status, answer, message in [
        (400, {"message": "bad"}, "answered 400"),
        (200, {"partialSuccess": {"rejectedSpans": 3, "errorMessage": "too old"}}, "rejected 3 of"),
    ]:
        with ThreadServer(Receiver(status, answer).app()) as srv:
            argv = ["export", str(fixture_run.run_dir), "--format", "otlp-json", "--otlp-endpoint", srv.url]
            assert harnessrl(argv) == 2
        assert message in capsys.readouterr().err
    assert harnessrl(["export", str(fixture_run.run_dir), "--format", "otlp-json", "--otlp-endpoint",
                      f"http://127.0.0.1:{ThreadServer(rx.app()).port}"]) == 2  # fmt: skip
    assert "cannot reach the OTLP collector" in capsys.readouterr().err


def test_cli_errors(fixture_run: Fixture, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["export", str(tmp_path / "none"), "--format", "jsonl", "--out", "x"], "no run directory at"),
        (["export", str(fixture_run.run_dir), "--format", "jsonl"], "say where to write"),
        (
            ["export", str(fixture_run.run_dir), "--format", "jsonl", "--otlp-endpoint", "http://x"],
            "goes with",
        ),
        (["export", str(fixture_run.run_dir), "--format", "csv", "--out", "x"], "invalid choice"),
        (["import", str(tmp_path / "none"), "--run-dir", str(tmp_path / "r")], "no file at"),
    ]
    for argv, message in cases:
        assert harnessrl(argv) == 2, argv
        assert message in capsys.readouterr().err


async def test_a_run_recorded_by_gateway_engine_and_harness_round_trips(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rollouts of the real calc harness through the real gateway and engine: export, validate, import."""
    from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
    from harnessrl.examples import get_example
    from harnessrl.gateway.client import ControlClient

    gw = make_gateway(default_max_tokens=12)
    run_dir = tmp_path / "run"
    example = get_example("calc")
    train, _ = example.build_splits(2, 1, 0)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec(command=example.harness_command, timeout_s=120), example.grader,
                     run_dir, concurrency=2)  # fmt: skip
    requests = [RolloutRequest(task=train[0], client_id=f"runx-s0-t-{k}", group_id="runx-s0-t", metadata={"step": 0})
                for k in range(2)]  # fmt: skip
    try:
        await ctl.run(requests)
    finally:
        await client.aclose()
    with sqlite3.connect(gw.store.path) as src, sqlite3.connect(run_dir / "store.sqlite") as dst:
        src.backup(dst)
    cfg = RunConfig.model_validate({"run_dir": str(run_dir), "engine": {"model": str(tiny_model_dir)}})
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    for fmt in ("jsonl", "trace", "otlp-json"):
        _export(run_dir, fmt, tmp_path / f"out.{fmt}")
        assert harnessrl(["validate", str(tmp_path / f"out.{fmt}")]) == 0
    rows = _jsonl(tmp_path / "out.jsonl")
    assert len(rows) >= 2 and all(r["n_trainable"] > 0 for r in rows)
    assert harnessrl(["import", str(tmp_path / "out.trace"), "--run-dir", str(tmp_path / "copy")]) == 0
    _export(tmp_path / "copy", "jsonl", tmp_path / "copy.jsonl")
    assert (tmp_path / "copy.jsonl").read_bytes() == (tmp_path / "out.jsonl").read_bytes()
