"""The rollout state machine and the SQLite store."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

import pytest

from harnessrl.schema import (
    ROLLOUT_TRANSITIONS,
    AttemptFinish,
    AttemptStatus,
    Call,
    CallStatus,
    InvalidTransition,
    RewardIn,
    RolloutCreate,
    RolloutState,
    check_transition,
    now,
)
from harnessrl.store import Conflict, NotFound, SQLiteStore


def test_transition_table_is_the_documented_machine() -> None:
    q, r, s, f, c = (RolloutState(x) for x in ("queued", "running", "succeeded", "failed", "cancelled"))
    assert ROLLOUT_TRANSITIONS[q] == {r, c, f}
    assert ROLLOUT_TRANSITIONS[r] == {q, s, f, c}
    for terminal in (s, f, c):
        assert ROLLOUT_TRANSITIONS[terminal] == frozenset()
        assert terminal.finished
    for a, b in itertools.product(RolloutState, RolloutState):
        if b in ROLLOUT_TRANSITIONS[a]:
            check_transition(a, b)
        else:
            with pytest.raises(InvalidTransition, match=f"from {a} to {b}"):
                check_transition(a, b)


def _call(rid: str, cid: str, attempt: int = 0) -> Call:
    return Call(
        call_id=cid, rollout_id=rid, attempt=attempt, created_at=now(), latency_s=0.01, status=CallStatus.OK,
        model="m", upstream="u", request={"messages": []}, prompt_ids=[1, 2], completion_ids=[3],
        completion_logprobs=[-0.5], weight_version=7,
    )  # fmt: skip


def test_store_lifecycle(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    ro, created = store.create_rollout(RolloutCreate(client_id="c1", task_id="t1", input={"q": 1}), "ra")
    assert created and ro.state == RolloutState.QUEUED
    again, created2 = store.create_rollout(RolloutCreate(client_id="c1", task_id="t1"), "rb")
    assert not created2 and again.rollout_id == "ra"
    with pytest.raises(Conflict):
        store.create_rollout(RolloutCreate(client_id="c1", task_id="other"), "rc")
    att = store.start_attempt("ra")
    assert att.attempt == 0 and store.get_rollout("ra").state == RolloutState.RUNNING  # type: ignore[union-attr]
    with pytest.raises(Conflict):  # running -> running is not a new attempt
        store.start_attempt("ra")
    first = store.add_call(_call("ra", "c-1"))
    second = store.add_call(_call("ra", "c-2"))
    assert (first.index, second.index) == (0, 1)
    assert [c.call_id for c in store.calls("ra")] == ["c-1", "c-2"]
    store.finish_attempt("ra", 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=3))
    store.set_reward("ra", RewardIn(value=0.5))
    store.set_reward("ra", RewardIn(value=1.0, details={"why": "last wins"}))
    assert store.get_reward("ra").value == 1.0  # type: ignore[union-attr]
    store.set_state("ra", RolloutState.SUCCEEDED)
    with pytest.raises(Conflict, match="from succeeded to running"):
        store.set_state("ra", RolloutState.RUNNING)
    with pytest.raises(NotFound):
        store.set_state("nope", RolloutState.RUNNING)
    detail = store.detail("ra")
    assert detail.attempts[0].exit_code == 3 and len(detail.calls) == 2 and detail.reward is not None
    store.close()
    reopened = SQLiteStore(tmp_path / "s.sqlite")
    assert reopened.detail("ra") == detail


def test_store_is_wal_and_pages_by_cursor(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    mode = sqlite3.connect(tmp_path / "s.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    for i in range(7):
        store.create_rollout(RolloutCreate(client_id=f"c{i}", task_id="t"), f"r{i}")
    store.start_attempt("r3")
    seen, cursor = [], 0
    while True:
        page, nxt = store.list_rollouts(limit=3, after=cursor)
        seen += [r.rollout_id for r in page]
        if nxt is None:
            break
        cursor = nxt
    assert seen == [f"r{i}" for i in range(7)]
    running, _ = store.list_rollouts(state=RolloutState.RUNNING)
    assert [r.rollout_id for r in running] == ["r3"]


def test_retry_path_requeues_then_runs_a_second_attempt(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    store.create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")
    store.start_attempt("r")
    store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.INFRA_ERROR, error="boom"))
    store.set_state("r", RolloutState.QUEUED)
    assert store.start_attempt("r").attempt == 1
    assert [a.status for a in store.attempts("r")] == [AttemptStatus.INFRA_ERROR, AttemptStatus.RUNNING]
