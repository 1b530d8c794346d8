"""The teacher's logprob of each trainable token beside the student's, for runs with `train.teacher`.

The trainer appends one line per trained row to `<run_dir>/teacher_logprobs.jsonl` (`step`,
`rollout_id`, `call_ids`, `teacher_logprobs` of the row's trainable tokens in order). A row of the
inspect report gets `teacher_logprobs` (one per token, None where the loss mask is 0) when a line names
the same rollout and calls and scores as many tokens as the row trains on (a row the trainer cut to
`train.max_row_tokens` does not match and is shown without).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "teacher_logprobs.jsonl"


def read_teacher_logprobs(run_dir: Path, rollout_id: str) -> dict[tuple[str, ...], list[float]]:
    """The teacher's logprobs of the rollout's rows, by their call ids (the latest step's line wins)."""
    path = run_dir / FILE
    out: dict[tuple[str, ...], list[float]] = {}
    if not path.is_file():
        return out
    with path.open() as f:
        for line in f:
            if rollout_id not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash mid-write
            if entry.get("rollout_id") == rollout_id:
                out[tuple(entry["call_ids"])] = entry["teacher_logprobs"]
    return out


def attach_teacher_logprobs(
    rows: list[dict[str, Any]], call_ids: list[list[str]], scored: dict[tuple[str, ...], list[float]]
) -> None:
    """Set each report row's `teacher_logprobs` (per token, None off the loss mask) where it was scored."""
    for row, ids in zip(rows, call_ids, strict=True):
        lps = scored.get(tuple(ids))
        if lps is None or len(lps) != row["n_trainable"]:
            continue
        it = iter(lps)
        row["teacher_logprobs"] = [next(it) if m else None for m in row["loss_mask"]]
