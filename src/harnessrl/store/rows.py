"""Rows <-> models: the columns both SQL stores read and how a row becomes a `schema` model.

SQLite and PostgreSQL keep the same tables with the same columns (JSON in TEXT columns), so the
decoding lives here once; each backend keeps only its SQL dialect, locking and numbering.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from harnessrl.schema import (
    Annotation,
    Attempt,
    AttemptStatus,
    Call,
    CallStatus,
    Reward,
    Rollout,
    RolloutEvent,
    RolloutState,
    SamplingOverrides,
    StepReward,
)

log = logging.getLogger(__name__)

ROLLOUT_COLS = (
    "rollout_id, client_id, task_id, group_id, state, input, metadata, sampling, "
    "created_at, updated_at, n_attempts, seq"
)
ATTEMPT_COLS = "rollout_id, attempt, status, started_at, ended_at, exit_code, error"
CALL_COLS = "call_id, rollout_id, attempt, idx, body"
# written: also the policy (several policies: the LoRA adapter that served the call), queryable by SQL
CALL_INSERT_COLS = "call_id, rollout_id, attempt, idx, body, policy"
EVENT_COLS = "seq, rollout_id, state, group_id, time"
REWARD_COLS = "value, details, updated_at, steps"
ANNOTATION_COLS = "seq, rollout_id, created_at, body"
READ_DEPTH = 100  # levels of nesting kept when a stored call is too deep for the fast reader

Row = tuple[Any, ...]


def dumps(obj: Any) -> str:
    """Compact JSON for a TEXT column."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def to_rollout(row: Row) -> Rollout:
    """A `ROLLOUT_COLS` row as a rollout."""
    return Rollout(
        rollout_id=row[0],
        client_id=row[1],
        task_id=row[2],
        group_id=row[3],
        state=RolloutState(row[4]),
        input=json.loads(row[5]),
        metadata=json.loads(row[6]),
        sampling=SamplingOverrides.model_validate_json(row[7]),
        created_at=row[8],
        updated_at=row[9],
        n_attempts=row[10],
    )


def rollout_page(rows: list[Row], limit: int) -> tuple[list[Rollout], int | None]:
    """A page of `list_rollouts` from up to `limit + 1` rows in `seq` order: the first `limit`
    rollouts, and the cursor of the next page (the last one's seq) when there is one more row."""
    page = rows[:limit]
    next_cursor = int(page[-1][-1]) if len(rows) > limit else None
    return [to_rollout(r) for r in page], next_cursor


def to_attempt(row: Row) -> Attempt:
    """An `ATTEMPT_COLS` row as an attempt."""
    rollout_id, number, status, started_at, ended_at, exit_code, error = row
    return Attempt(rollout_id=rollout_id, attempt=number, status=AttemptStatus(status), started_at=started_at,
                   ended_at=ended_at, exit_code=exit_code, error=error)  # fmt: skip


def to_event(row: Row) -> RolloutEvent:
    """An `EVENT_COLS` row as a rollout event."""
    seq, rollout_id, state, group_id, time = row
    return RolloutEvent(
        seq=seq, rollout_id=rollout_id, state=RolloutState(state), group_id=group_id, time=time
    )


def to_reward(rollout_id: str, row: Row) -> Reward:
    """A `REWARD_COLS` row of `rollout_id` as its reward."""
    value, details, updated_at, steps = row
    return Reward(rollout_id=rollout_id, value=value, details=json.loads(details), updated_at=updated_at,
                  steps=[StepReward.model_validate(s) for s in json.loads(steps or "[]")])  # fmt: skip


def steps_json(steps: list[StepReward]) -> str:
    """A reward's step rewards for the `steps` TEXT column."""
    return dumps([s.model_dump(mode="json", exclude_defaults=True) for s in steps])


def to_annotation(row: Row) -> Annotation:
    """An `ANNOTATION_COLS` row as an annotation (its number is the row's seq)."""
    seq, rollout_id, created_at, body = row
    return Annotation.model_validate({**json.loads(body), "seq": seq, "rollout_id": rollout_id,
                                      "created_at": created_at})  # fmt: skip


def to_call(row: Row) -> Call:
    """A `CALL_COLS` row as a call, whatever its row holds: a reader never fails on one row.

    Pydantic's JSON reader stops at ~200 levels of nesting, which rows stored before the gateway's
    door policy (64 levels) may pass: those are read with Python's parser and cut at `READ_DEPTH`
    levels. A row that cannot be read at all comes back as a failed call that says so."""
    call_id, rollout_id, attempt, idx, body = row
    try:
        return Call.model_validate_json(body)
    except ValueError:
        pass
    try:
        return Call.model_validate(clip_depth(json.loads(body), READ_DEPTH))
    except (ValueError, RecursionError) as e:
        log.error("event=call_unreadable call=%s error=%s", call_id, e)
        return Call(call_id=call_id, rollout_id=rollout_id, attempt=attempt, index=idx, created_at=0.0,
                    latency_s=0.0, status=CallStatus.FAILED, model="", upstream="", request={},
                    error=f"the stored record of this call cannot be read: {str(e)[:300]}")  # fmt: skip


def call_row(c: Call) -> Row:
    """The `CALL_INSERT_COLS` values of a call (its index already assigned)."""
    return (c.call_id, c.rollout_id, c.attempt, c.index, c.model_dump_json(), c.policy)


def clip_depth(value: Any, max_depth: int) -> Any:
    """`value` with every object/array below `max_depth` levels replaced by a string saying so."""
    if not isinstance(value, dict | list):
        return value
    if max_depth <= 0:
        return f"<cut: nested deeper than {READ_DEPTH} levels>"
    if isinstance(value, dict):
        return {k: clip_depth(v, max_depth - 1) for k, v in value.items()}
    return [clip_depth(v, max_depth - 1) for v in value]
