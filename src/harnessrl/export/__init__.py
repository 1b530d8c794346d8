"""export: a run's record for other tools (`harnessrl export`, `harnessrl validate`, `harnessrl import`).

Modules, outside in: `cli` (the three commands), `writers` (rows to JSONL and Parquet), `schemas`
(the committed JSON Schemas and file validation), `otlp` (rollouts as OpenTelemetry traces with the
GenAI conventions, OTLP/JSON and OTLP/HTTP), `traces` (our own trace format: write, read, import into a
fresh store), `rows` (the training rows as the trainer built them, through the adapter). The run is read
with `harnessrl.inspection.runview`. Nothing here imports torch.
"""

from __future__ import annotations

from harnessrl.export.rows import ROWS_SCHEMA_VERSION, TrainingRow, iter_rows
from harnessrl.export.traces import TraceHeader, TraceRollout, import_trace, read_trace, trace_lines

__all__ = [
    "ROWS_SCHEMA_VERSION",
    "TraceHeader",
    "TraceRollout",
    "TrainingRow",
    "import_trace",
    "iter_rows",
    "read_trace",
    "trace_lines",
]
