"""Length limits: rows longer than the trainer's context budget, and rows that are too stale.

Truncation rule (documented in docs/concepts.md): a row longer than `max_tokens` keeps its first
`max_tokens` tokens and loses the tail. Every kept trainable token was sampled by the engine after
exactly the kept tokens before it, so its recorded logprob stays valid and no token the model did not
sample is ever trained on. A row whose first trainable token lies at or past the budget (its prompt
alone fills the context) has nothing left to train on and is dropped. Nothing here raises on length.

Staleness: a row's staleness at weight version v is v − (the oldest weight version among its calls);
with a bound S, rows staler than S are dropped. Calls with no recorded version count as current.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from harnessrl.adapter.merge import Row


@dataclass
class LengthReport:
    """What the length limit did to a batch's rows."""

    truncated_rows: int = 0
    dropped_rows: int = 0
    truncated_tokens: int = 0  # trainable tokens lost to truncation (of kept and dropped rows)


def truncate_row(row: Row, max_tokens: int) -> Row | None:
    """The row cut to its first `max_tokens` tokens, or None if no trainable token would remain."""
    if len(row.tokens) <= max_tokens:
        return row
    if sum(row.loss_mask[:max_tokens]) == 0:
        return None
    return replace(
        row,
        tokens=row.tokens[:max_tokens],
        loss_mask=row.loss_mask[:max_tokens],
        old_logprobs=row.old_logprobs[:max_tokens],
    )


def apply_length_limit(rows: Sequence[Row], max_tokens: int | None) -> tuple[list[Row], LengthReport]:
    """Apply the truncation rule (module docstring) to every row; `None` keeps all rows as they are."""
    report = LengthReport()
    if max_tokens is None:
        return list(rows), report
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    kept: list[Row] = []
    for row in rows:
        cut = truncate_row(row, max_tokens)
        if cut is not row:
            report.truncated_tokens += row.n_trainable - (cut.n_trainable if cut is not None else 0)
            if cut is None:
                report.dropped_rows += 1
                continue
            report.truncated_rows += 1
        kept.append(cut)
    return kept, report


def row_staleness(row: Row, version: int) -> int:
    """How many weight versions behind `version` the oldest call of the row was served."""
    versions = [v for v in row.weight_versions if v is not None]
    return max(0, version - min(versions)) if versions else 0


@dataclass
class StalenessReport:
    """Rows per staleness value, and how many were dropped for exceeding the bound."""

    histogram: Counter[int] = field(default_factory=Counter)
    dropped_rows: int = 0

    def as_dict(self) -> dict[str, int]:
        """JSON-ready histogram {"0": n0, "1": n1, ...}."""
        return {str(k): v for k, v in sorted(self.histogram.items())}


def filter_stale(
    rows: Sequence[Row], version: int, max_staleness: int | None
) -> tuple[list[Row], StalenessReport]:
    """Rows within the staleness bound at `version` (all rows if the bound is None), and the report."""
    report = StalenessReport()
    kept: list[Row] = []
    for row in rows:
        s = row_staleness(row, version)
        report.histogram[s] += 1
        if max_staleness is not None and s > max_staleness:
            report.dropped_rows += 1
            continue
        kept.append(row)
    return kept, report
