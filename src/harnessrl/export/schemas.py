"""The JSON Schemas of the exported formats, generated from their pydantic models and committed.

`schemas/trace-v<N>.schema.json` describes a line of our trace file (`export.traces`: a header line or
a rollout line), `schemas/rows-v<N>.schema.json` a training row (`export.rows`, one JSONL line or one
Parquet record). `python -m harnessrl.export.schemas` rewrites them; a test keeps them current.
`validate_file` checks a file against them (package `jsonschema`) and names the first bad line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from harnessrl.export.rows import ROWS_SCHEMA_VERSION, TrainingRow
from harnessrl.export.traces import HEADER_KIND, TraceHeader, TraceRollout, open_text
from harnessrl.schema import TRACE_SCHEMA_VERSION

SCHEMA_DIR = Path(__file__).with_name("schemas")
TRACE_SCHEMA = f"trace-v{TRACE_SCHEMA_VERSION}.schema.json"
ROWS_SCHEMA = f"rows-v{ROWS_SCHEMA_VERSION}.schema.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def trace_schema() -> dict[str, Any]:
    """The JSON Schema of a trace-file line (header or rollout), generated from the models."""
    header = TraceHeader.model_json_schema(ref_template="#/$defs/{model}")
    rollout = TraceRollout.model_json_schema(ref_template="#/$defs/{model}")
    defs = {**header.pop("$defs", {}), **rollout.pop("$defs", {})}
    defs["TraceHeader"], defs["TraceRollout"] = header, rollout
    return {
        "$schema": DIALECT,
        "$id": f"urn:harnessrl:schema:trace:v{TRACE_SCHEMA_VERSION}",
        "title": f"harnessrl trace line, schema version {TRACE_SCHEMA_VERSION}",
        "description": "One line of a harnessrl trace file (JSON Lines): the first line is a TraceHeader, "
        "every further line a TraceRollout. See docs/export.md.",
        "oneOf": [{"$ref": "#/$defs/TraceHeader"}, {"$ref": "#/$defs/TraceRollout"}],
        "$defs": dict(sorted(defs.items())),
    }


def rows_schema() -> dict[str, Any]:
    """The JSON Schema of an exported training row, generated from `TrainingRow`."""
    body = TrainingRow.model_json_schema(ref_template="#/$defs/{model}")
    return {
        "$schema": DIALECT,
        "$id": f"urn:harnessrl:schema:rows:v{ROWS_SCHEMA_VERSION}",
        **body,
        "title": f"harnessrl training row, schema version {ROWS_SCHEMA_VERSION}",
    }


def generated() -> dict[str, dict[str, Any]]:
    """File name → schema, for every committed schema."""
    return {TRACE_SCHEMA: trace_schema(), ROWS_SCHEMA: rows_schema()}


def dump(schema: dict[str, Any]) -> str:
    """The committed text of a schema."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def load(name: str) -> dict[str, Any]:
    """A committed schema by file name."""
    text = resources.files("harnessrl.export").joinpath("schemas", name).read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


class InvalidFile(ValueError):
    """A file that does not match its schema; the message names the line (or record) and the field."""


def _validator(name: str, part: str | None = None) -> Any:
    """A validator for a committed schema, or for one of its `$defs` (`part`)."""
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - jsonschema is in the export extra
        raise InvalidFile("validating needs the jsonschema package: pip install 'harnessrl[export]'") from e
    schema = load(name)
    if part is not None:
        schema = {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": f"#/$defs/{part}"}
    return jsonschema.Draft202012Validator(schema)


def _check(validator: Any, record: Any, where: str) -> None:
    from jsonschema.exceptions import best_match

    err = best_match(validator.iter_errors(record))
    if err is not None:
        path = "/".join(str(p) for p in err.absolute_path) or "(record)"
        raise InvalidFile(f"{where}: {path}: {err.message[:300]}")


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    with open_text(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidFile(f"{path}:{n}: not JSON ({e})") from e


def detect(path: Path) -> str:
    """What a file holds: "rows-parquet", "rows-jsonl", "trace" or "otlp-json"."""
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1":
        return "rows-parquet"
    first = next(_json_lines(path), None)
    if first is None:
        raise InvalidFile(f"{path} is empty")
    record = first[1]
    if isinstance(record, dict) and "resourceSpans" in record:
        return "otlp-json"
    if isinstance(record, dict) and record.get("kind") == HEADER_KIND:
        return "trace"
    if isinstance(record, dict) and "input_ids" in record:
        return "rows-jsonl"
    raise InvalidFile(
        f"{path}:{first[0]}: neither a harnessrl trace, training rows nor an OTLP/JSON document"
    )


def _version_check(record: Any, wanted: int, what: str, where: str) -> None:
    got = record.get("schema_version") if isinstance(record, dict) else None
    if got != wanted:
        raise InvalidFile(f"{where}: {what} schema version {got!r}; this harnessrl reads version {wanted}")


def validate_file(path: Path) -> tuple[str, int]:
    """Check every record of `path` against its schema; returns (kind, records checked)."""
    kind = detect(path)
    if kind == "trace":
        header, rollout = _validator(TRACE_SCHEMA, "TraceHeader"), _validator(TRACE_SCHEMA, "TraceRollout")
        n = announced = 0
        for line_no, record in _json_lines(path):
            _version_check(record, TRACE_SCHEMA_VERSION, "trace", f"{path}:{line_no}")
            is_header = record.get("kind") == HEADER_KIND
            _check(header if is_header else rollout, record, f"{path}:{line_no}")
            if (n == 0) != is_header:
                raise InvalidFile(f"{path}:{line_no}: the header must be the first line, and only it")
            announced = record["rollouts"] if is_header else announced
            n += 1
        if n - 1 != announced:
            raise InvalidFile(f"{path}: the header announces {announced} rollouts but {n - 1} follow")
        return kind, n
    if kind == "otlp-json":
        return kind, _validate_otlp(path)
    v = _validator(ROWS_SCHEMA)
    records = _parquet_records(path) if kind == "rows-parquet" else _json_lines(path)
    n = 0
    for where, record in records:
        loc = f"{path}: record {where}" if kind == "rows-parquet" else f"{path}:{where}"
        _version_check(record, ROWS_SCHEMA_VERSION, "rows", loc)
        _check(v, record, loc)
        n += 1
    return kind, n


def _parquet_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    from harnessrl.export.writers import read_parquet_rows

    yield from enumerate(read_parquet_rows(path), start=1)


def _validate_otlp(path: Path) -> int:
    """Parse an OTLP/JSON file with OpenTelemetry's protobuf definitions; returns the span count."""
    from harnessrl.export.otlp import parse_with_proto

    try:
        from google.protobuf import json_format
    except ImportError as e:
        raise InvalidFile("validating OTLP needs: pip install opentelemetry-proto") from e
    n = 0
    for line_no, doc in _json_lines(path):
        try:
            req = parse_with_proto(doc)
        except ImportError as e:
            raise InvalidFile("validating OTLP needs: pip install opentelemetry-proto") from e
        except (json_format.ParseError, ValueError, TypeError, AttributeError) as e:
            raise InvalidFile(f"{path}:{line_no}: not an OTLP ExportTraceServiceRequest: {e}") from e
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if len(span.trace_id) != 16 or len(span.span_id) != 8:
                        raise InvalidFile(
                            f"{path}:{line_no}: span {span.name!r} has a malformed trace/span id"
                        )
                    n += 1
    return n


def main() -> int:
    """Rewrite the committed schemas from the models."""
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, schema in generated().items():
        (SCHEMA_DIR / name).write_text(dump(schema))
        print(SCHEMA_DIR / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
