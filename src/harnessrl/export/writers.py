"""Training rows to files: JSON Lines (no extra package) and Parquet (package pyarrow).

The Parquet columns follow `rows.TrainingRow` with explicit Arrow types (`ROW_ARROW_TYPES`): token ids
int32 lists, the loss mask an int8 list, logprobs and weights float64 lists, so a reader gets the same
values back as the JSONL form. The file's metadata carries `harnessrl.rows_schema_version`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from harnessrl.export.rows import ROWS_SCHEMA_VERSION, TrainingRow

# column -> Arrow type name (list<...> for sequences), in TrainingRow's field order
ROW_ARROW_TYPES: dict[str, str] = {
    "schema_version": "int32", "run_id": "string", "step": "int32", "group_index": "int32",
    "rollout_id": "string", "group_id": "string", "task_id": "string", "attempt": "int32",
    "row_index": "int32", "call_ids": "list<string>", "weight_versions": "list<int64>", "policy": "string",
    "temperature": "float64", "reward": "float64", "advantage": "float64", "input_ids": "list<int32>",
    "loss_mask": "list<int8>", "old_logprobs": "list<float64>", "token_weights": "list<float64>",
    "n_tokens": "int32", "n_trainable": "int32", "token_advantages": "list<float64>",
}  # fmt: skip
NULLABLE = frozenset({"run_id", "step", "group_index", "token_advantages", "policy"})
PARQUET_BATCH_ROWS = 512


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise RuntimeError("Parquet needs the pyarrow package: pip install 'harnessrl[export]'") from e
    return pyarrow


def arrow_schema() -> Any:
    """The Arrow schema of the Parquet rows file."""
    pa = _pyarrow()

    def typ(name: str) -> Any:
        if name.startswith("list<"):
            return pa.list_(typ(name[5:-1]))
        return getattr(pa, name)()

    assert list(ROW_ARROW_TYPES) == list(TrainingRow.model_fields), "ROW_ARROW_TYPES must follow TrainingRow"
    fields = [pa.field(k, typ(v), nullable=k in NULLABLE) for k, v in ROW_ARROW_TYPES.items()]
    return pa.schema(fields, metadata={"harnessrl.rows_schema_version": str(ROWS_SCHEMA_VERSION)})


def _tmp(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def write_jsonl(rows: Iterable[TrainingRow], out: Path) -> int:
    """One JSON object per row; returns the count. Written atomically."""
    tmp, n = _tmp(out), 0
    try:
        with tmp.open("w") as f:
            for row in rows:
                f.write(row.model_dump_json() + "\n")
                n += 1
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_parquet(rows: Iterable[TrainingRow], out: Path) -> int:
    """A Parquet file of the rows (row groups of `PARQUET_BATCH_ROWS`); returns the count."""
    pa = _pyarrow()
    schema = arrow_schema()
    tmp, n = _tmp(out), 0
    try:
        with pa.parquet.ParquetWriter(str(tmp), schema) as writer:
            chunk: list[dict[str, Any]] = []
            for row in rows:
                chunk.append(row.model_dump())
                if len(chunk) == PARQUET_BATCH_ROWS:
                    writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                    n, chunk = n + len(chunk), []
            if chunk or n == 0:
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                n += len(chunk)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def read_parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a Parquet rows file as plain dicts (batch by batch)."""
    pa = _pyarrow()
    f = pa.parquet.ParquetFile(str(path))
    for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        yield from batch.to_pylist()
