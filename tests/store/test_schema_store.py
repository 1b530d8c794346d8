"""The rollout state machine and the store, on both backends (SQLite, and a real PostgreSQL)."""

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
from tests.support.store_fixtures import StoreFactory


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


def test_store_lifecycle(store_factory: StoreFactory) -> None:
    store = store_factory.open()
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
    reopened = store_factory.open()
    assert reopened.detail("ra") == detail


def test_sqlite_store_is_wal(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.sqlite")
    mode = sqlite3.connect(tmp_path / "s.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_store_pages_by_cursor(store_factory: StoreFactory) -> None:
    store = store_factory.open()
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


def test_retry_path_requeues_then_runs_a_second_attempt(store_factory: StoreFactory) -> None:
    store = store_factory.open()
    store.create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")
    store.start_attempt("r")
    store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.INFRA_ERROR, error="boom"))
    store.set_state("r", RolloutState.QUEUED)
    assert store.start_attempt("r").attempt == 1
    assert [a.status for a in store.attempts("r")] == [AttemptStatus.INFRA_ERROR, AttemptStatus.RUNNING]


def test_events_are_numbered_in_order_and_wake_a_waiter(store_factory: StoreFactory) -> None:
    store = store_factory.open()
    store.create_rollout(RolloutCreate(client_id="c", task_id="t", group_id="g"), "r")
    store.start_attempt("r")
    store.set_state("r", RolloutState.SUCCEEDED)
    store.set_state("r", RolloutState.SUCCEEDED)  # a repeat is no new event
    events = store.events()
    assert [e.state for e in events] == [RolloutState.QUEUED, RolloutState.RUNNING, RolloutState.SUCCEEDED]
    assert [e.seq for e in events] == sorted({e.seq for e in events}) and events[0].group_id == "g"
    assert [e.seq for e in store.events(after=events[0].seq)] == [e.seq for e in events[1:]]
    assert store.wait_events(after=events[1].seq, timeout_s=5)  # already there: at once
    assert not store.wait_events(after=events[-1].seq, timeout_s=0.2)


def test_store_errors_name_the_problem(store_factory: StoreFactory) -> None:
    store = store_factory.open()
    with pytest.raises(NotFound, match="rollout 'missing' not found"):
        store.set_reward("missing", RewardIn(value=1.0))
    with pytest.raises(NotFound):
        store.start_attempt("missing")
    store.create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")
    with pytest.raises(NotFound, match="attempt 0"):
        store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.EXITED))
    store.start_attempt("r")
    store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))
    store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))  # repeat: no-op
    with pytest.raises(Conflict, match="already ended as exited"):
        store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.TIMEOUT))
    with pytest.raises(Conflict, match="running"):
        store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.RUNNING))
    assert store.get_reward("r") is None and store.get_rollout("missing") is None


def test_meta_keeps_the_first_value_and_calls_page_from_the_end(store_factory: StoreFactory) -> None:
    store = store_factory.open()
    assert store.get_meta("secret") is None
    assert store.set_meta_if_absent("secret", "a") == "a"
    assert store.set_meta_if_absent("secret", "b") == "a"
    assert store_factory.open().get_meta("secret") == "a"
    store.set_meta("paused", "1")
    store.set_meta("paused", "0")  # set_meta: the last write wins
    assert store_factory.open().get_meta("paused") == "0"
    store.create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")
    stored = store.add_calls([_call("r", f"c-{i}") for i in range(5)])
    assert [c.index for c in stored] == list(range(5))
    assert store.count_calls("r") == 5 and store.count_calls("other") == 0
    assert [c.call_id for c in store.recent_calls("r", 2)] == ["c-3", "c-4"]
    assert store.calls("r")[4].completion_logprobs == [-0.5] and store.calls("r")[4].weight_version == 7
    with pytest.raises(Exception):  # noqa: B017 - the same call id twice is refused, whatever the backend
        store.add_call(_call("r", "c-0"))
    assert store.count_calls("r") == 5
    assert store.add_call(_call("r", "c-5")).index == 5  # numbering goes on after a failed write
