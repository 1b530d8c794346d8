"""Our own trace format: a run's whole record as JSON Lines, to keep, validate and import again.

Line 1 is a `TraceHeader` (the run's id, config, metrics and summary); every further line is a
`TraceRollout`: one rollout with its attempts, its calls (token ids, logprobs, the conversation) and
its reward, exactly as the store holds them. `import_trace` writes such a file into a fresh run
directory (`store.sqlite`, `config.json`, `metrics.jsonl`, `summary.json`), from which `inspect`,
the dashboard and the row export read the same rows as from the original run.

The format is versioned by `schema.TRACE_SCHEMA_VERSION`; its JSON Schema is generated from these
models (`harnessrl.export.schemas`).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harnessrl.inspection.runview import RunError, all_rollouts
from harnessrl.schema import TRACE_SCHEMA_VERSION, RolloutDetail
from harnessrl.store import SQLiteStore, Store
from harnessrl.store.base import Conflict

HEADER_KIND: Final = "harnessrl.trace.header"
ROLLOUT_KIND: Final = "harnessrl.trace.rollout"


class TraceHeader(BaseModel):
    """The first line of a trace file: which run, with which settings and results."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["harnessrl.trace.header"] = Field(description="marks the header line")
    schema_version: Literal[1] = Field(description="TRACE_SCHEMA_VERSION of the writer")
    run_id: str | None = Field(description="the run's id (run.json), None when unknown")
    config: dict[str, Any] = Field(description="the run's config.json ({} when absent)")
    metrics: list[dict[str, Any]] = Field(description="the records of metrics.jsonl, one per step")
    summary: dict[str, Any] | None = Field(description="summary.json, None when the run has none yet")
    rollouts: int = Field(description="how many rollout lines follow")


class TraceRollout(RolloutDetail):
    """One rollout line: the rollout, its attempts, calls and reward as stored."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["harnessrl.trace.rollout"] = Field(description="marks a rollout line")
    schema_version: Literal[1] = Field(description="TRACE_SCHEMA_VERSION of the writer")


def run_files(
    run_dir: Path,
) -> tuple[str | None, dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """The run's id, config, metrics records and summary from its directory (empty when absent)."""

    def load(name: str) -> Any:
        path = run_dir / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{path} is not readable JSON ({e})") from e

    marker = load("run.json")
    run_id = marker.get("run_id") if isinstance(marker, dict) else None
    metrics_path = run_dir / "metrics.jsonl"
    metrics = []
    if metrics_path.is_file():
        metrics = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    return run_id, load("config.json") or {}, metrics, load("summary.json")


def trace_lines(store: Store, run_dir: Path) -> Iterator[str]:
    """The lines of the run's trace file: the header, then one line per rollout in creation order."""
    run_id, config, metrics, summary = run_files(run_dir)
    rollouts = all_rollouts(store)
    header = TraceHeader(kind=HEADER_KIND, schema_version=TRACE_SCHEMA_VERSION, run_id=run_id, config=config,
                         metrics=metrics, summary=summary, rollouts=len(rollouts))  # fmt: skip
    yield header.model_dump_json()
    for r in rollouts:
        d = store.detail(r.rollout_id)
        line = TraceRollout(kind=ROLLOUT_KIND, schema_version=TRACE_SCHEMA_VERSION, **dict(d))
        yield line.model_dump_json()


def open_text(path: Path) -> IO[str]:
    """A text file for reading, decompressed when it is gzip (a trace may be kept as .jsonl.gz)."""
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")


class TraceError(ValueError):
    """A trace file that cannot be read or imported; the message names the line and the field."""


def read_trace(lines: Iterable[str], source: str = "trace") -> tuple[TraceHeader, Iterator[TraceRollout]]:
    """Parse a trace file's header and (lazily) its rollout lines, checking each against the models."""
    it = iter(enumerate(lines, start=1))
    first = next(((n, x) for n, x in it if x.strip()), None)
    if first is None:
        raise TraceError(f"{source} is empty; a harnessrl trace starts with a header line")
    try:
        header = TraceHeader.model_validate_json(first[1])
    except ValidationError as e:
        raise TraceError(f"{source}:{first[0]}: not a harnessrl trace header: {_first_error(e)}") from e

    def body() -> Iterator[TraceRollout]:
        for n, text in it:
            if not text.strip():
                continue
            try:
                yield TraceRollout.model_validate_json(text)
            except ValidationError as e:
                raise TraceError(f"{source}:{n}: {_first_error(e)}") from e

    return header, body()


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(line)"
    return f"{where}: {err['msg']} ({e.error_count()} error(s))"


def import_trace(path: Path, run_dir: Path) -> int:
    """Write the trace file at `path` into the new run directory `run_dir` (absent or empty); returns
    the number of rollouts imported. The run's files are written as the original run left them."""
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise TraceError(f"{run_dir} exists and is not an empty directory; import into a new run directory")
    with open_text(path) as f:
        header, rollouts = read_trace(f, str(path))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(header.config, indent=2))
        if header.run_id is not None:
            (run_dir / "run.json").write_text(json.dumps({"run_id": header.run_id}))
        if header.metrics:
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in header.metrics))
        if header.summary is not None:
            (run_dir / "summary.json").write_text(json.dumps(header.summary, indent=2))
        store = SQLiteStore(run_dir / "store.sqlite")
        n = 0
        try:
            for r in rollouts:
                try:
                    store.import_detail(RolloutDetail.model_validate(dict(r)))
                except Conflict as e:
                    raise TraceError(f"{path}: rollout {n + 1}: {e}") from e
                n += 1
        finally:
            store.close()
    if n != header.rollouts:
        raise TraceError(
            f"{path}: the header announces {header.rollouts} rollouts but {n} followed (cut short?)"
        )
    return n


def write_lines(lines: Iterable[str], out: Path) -> int:
    """Write lines to `out` atomically (a temporary file renamed into place); returns the count."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with tmp.open("w") as f:
            for line in lines:
                f.write(line + "\n")
                n += 1
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return n
