"""`harnessrl export`, `harnessrl validate` and `harnessrl import`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harnessrl.export import otlp
from harnessrl.export.rows import iter_rows
from harnessrl.export.schemas import InvalidFile, validate_file
from harnessrl.export.traces import TraceError, import_trace, run_files, trace_lines, write_lines
from harnessrl.export.writers import write_jsonl, write_parquet
from harnessrl.inspection.runview import RunError, advantages, all_rollouts, open_run_store, read_settings

FORMATS = ("parquet", "jsonl", "trace", "otlp-json")
OTLP_BATCH_ROLLOUTS = 50

EXPORT_HELP = """Write what a run recorded for other tools. parquet / jsonl: the training rows as the
trainer built them (tokens, loss mask, old logprobs, advantage, per-token loss weights, rollout and
group ids). trace: the whole record (rollouts, attempts, calls, rewards, config, metrics) in harnessrl's
versioned trace format, which `harnessrl import` reads back. otlp-json: one OpenTelemetry trace per
rollout (GenAI semantic conventions), as OTLP/JSON lines; --otlp-endpoint sends them to a collector."""


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code argparse chose (`--help`: 0, a usage error: 2)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("harnessrl")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "0"


def _error(cmd: str, message: str) -> int:
    print(f"harnessrl {cmd}: {message}", file=sys.stderr)
    return 2


def export_parser() -> argparse.ArgumentParser:
    """The argument parser of `harnessrl export`."""
    p = argparse.ArgumentParser(prog="harnessrl export", description=EXPORT_HELP)
    p.add_argument("run_dir", type=Path, help="the run's directory (its run_dir, e.g. runs/demo)")
    p.add_argument("--format", choices=FORMATS, required=True, help="what to write (see above)")
    p.add_argument("--out", type=Path, help="the file to write (required unless --otlp-endpoint)")
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="with --format otlp-json: POST the traces to this OTLP/HTTP collector "
                   "(e.g. http://127.0.0.1:4318; /v1/traces is added)")  # fmt: skip
    p.add_argument("--otlp-header", action="append", default=[], metavar="NAME=VALUE",
                   help="an HTTP header for the collector (repeatable), e.g. authorization=Bearer x")  # fmt: skip
    return p


def _otlp_documents(
    store: Any, run_dir: Path, run_id: str | None, agent: str | None
) -> Iterator[dict[str, Any]]:
    settings = read_settings(run_dir)
    everything = all_rollouts(store)
    for chunk in otlp.batched(everything, OTLP_BATCH_ROLLOUTS):
        adv = advantages(store, chunk, everything, settings)
        spans = [s for r in chunk for s in otlp.rollout_spans(store.detail(r.rollout_id), settings, agent,
                                                                 adv.get(r.rollout_id))]  # fmt: skip
        yield otlp.otlp_document(spans, run_id, _version())


def export_main(argv: list[str]) -> int:
    """Entry point of `harnessrl export`; returns the exit code."""
    args = _parse(export_parser(), argv)
    if isinstance(args, int):
        return args
    if args.otlp_endpoint and args.format != "otlp-json":
        return _error("export", "--otlp-endpoint goes with --format otlp-json")
    if args.out is None and not args.otlp_endpoint:
        return _error("export", "say where to write: --out PATH (or --otlp-endpoint URL with otlp-json)")
    headers = {}
    for h in args.otlp_header:
        if "=" not in h:
            return _error("export", f"--otlp-header {h!r} is not NAME=VALUE")
        k, v = h.split("=", 1)
        headers[k.strip()] = v.strip()
    run_dir: Path = args.run_dir.expanduser().resolve()
    try:
        store = open_run_store(run_dir)
    except RunError as e:
        return _error("export", str(e))
    try:
        run_id, config, _, _ = run_files(run_dir)
        if args.format in ("parquet", "jsonl"):
            rows = iter_rows(store, read_settings(run_dir), run_id)
            write: Callable[..., int] = write_parquet if args.format == "parquet" else write_jsonl
            n = write(rows, args.out)
            what = f"{n} training rows"
        elif args.format == "trace":
            n = write_lines(trace_lines(store, run_dir), args.out) - 1
            what = f"the trace of {n} rollouts"
        else:
            agent = config.get("name") if isinstance(config.get("name"), str) else None
            docs = _otlp_documents(store, run_dir, run_id, agent)
            if args.otlp_endpoint:
                if args.out is not None:
                    docs = _tee(docs, args.out)
                n = otlp.post_otlp(docs, args.otlp_endpoint, headers=headers)
                print(f"sent {n} spans to {otlp.traces_url(args.otlp_endpoint)}")
                return 0
            n = write_lines(_spans_counted(docs, counter := [0]), args.out)
            what = f"{counter[0]} spans in {n} OTLP/JSON documents"
    except (RunError, RuntimeError, OSError) as e:
        return _error("export", str(e))
    finally:
        store.close()
    print(f"wrote {what} to {args.out}")
    return 0


def _spans_counted(docs: Iterator[dict[str, Any]], counter: list[int]) -> Iterator[str]:
    import json

    for d in docs:
        counter[0] += sum(len(s["spans"]) for rs in d["resourceSpans"] for s in rs["scopeSpans"])
        yield json.dumps(d, ensure_ascii=False)


def _tee(docs: Iterator[dict[str, Any]], out: Path) -> Iterator[dict[str, Any]]:
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            yield d


PARSERS = {
    "validate": "Check exported files against harnessrl's versioned JSON Schemas (trace files, training rows "
    "as JSONL or Parquet) or OpenTelemetry's protobuf definitions (OTLP/JSON).",
    "import": "Read a harnessrl trace file (harnessrl export --format trace) into a new run directory, which "
    "inspect, the dashboard and export then read like the original run.",
}


def command_parser(command: str) -> argparse.ArgumentParser:
    """The argument parser of `harnessrl validate` or `harnessrl import`."""
    p = argparse.ArgumentParser(prog=f"harnessrl {command}", description=PARSERS[command])
    if command == "validate":
        p.add_argument("files", type=Path, nargs="+")
    else:
        p.add_argument("trace", type=Path, help="the trace file")
        p.add_argument("--run-dir", type=Path, required=True, help="the new run directory (absent or empty)")
    return p


def validate_main(argv: list[str]) -> int:
    """Entry point of `harnessrl validate FILE...`: 0 when every file matches its schema, else 1."""
    args = _parse(command_parser("validate"), argv)
    if isinstance(args, int):
        return args
    rc = 0
    for path in args.files:
        if not path.is_file():
            rc = max(rc, _error("validate", f"no file at {path}"))
            continue
        try:
            kind, n = validate_file(path)
        except InvalidFile as e:
            print(f"harnessrl validate: INVALID {e}", file=sys.stderr)
            rc = max(rc, 1)
            continue
        print(f"{path}: valid {kind} ({n} records)")
    return rc


def import_main(argv: list[str]) -> int:
    """Entry point of `harnessrl import TRACE --run-dir DIR`."""
    args = _parse(command_parser("import"), argv)
    if isinstance(args, int):
        return args
    if not args.trace.is_file():
        return _error("import", f"no file at {args.trace}")
    try:
        n = import_trace(args.trace, args.run_dir)
    except (TraceError, OSError) as e:
        return _error("import", str(e))
    print(f"imported {n} rollouts into {args.run_dir}")
    return 0
