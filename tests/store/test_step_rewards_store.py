"""Step rewards and annotations in both stores (real SQLite files, a real PostgreSQL server), and the
upgrade of stores written before them (SQLite: a column added at open; PostgreSQL: migration 2)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from harnessrl.schema import AnnotationIn, RewardIn, RolloutCreate, StepReward
from harnessrl.store import NotFound, SQLiteStore, Store


def _rollout(store: Store, rid: str = "r1") -> str:
    store.create_rollout(RolloutCreate(client_id=rid, task_id="t"), rid)
    return rid


def test_step_rewards_round_trip_and_the_last_write_wins(store: Store) -> None:
    rid = _rollout(store)
    steps = [
        StepReward(call=0, value=0.5, details={"why": "ok"}),
        StepReward(tool_call_id="tc-1", value=-1.0),
    ]
    written = store.set_reward(rid, RewardIn(value=1.0, steps=steps))
    assert written.steps == steps
    got = store.get_reward(rid)
    assert got is not None and got.steps == steps and got.value == 1.0
    store.set_reward(rid, RewardIn(value=0.0))
    again = store.get_reward(rid)
    assert again is not None and again.steps == [] and again.value == 0.0


def test_annotations_are_numbered_in_order_and_in_the_detail(store: Store) -> None:
    rid = _rollout(store)
    other = _rollout(store, "r2")
    first = store.add_annotation(rid, AnnotationIn(call=0, label="plan", details={"n": 1}))
    second = store.add_annotation(rid, AnnotationIn(tool_call_id="tc-9", value=0.25))
    store.add_annotation(other, AnnotationIn(call=3, label="elsewhere"))
    assert first.seq < second.seq and first.rollout_id == rid
    detail = store.detail(rid)
    assert [(a.call, a.tool_call_id, a.label, a.value) for a in detail.annotations] == [
        (0, None, "plan", None),
        (None, "tc-9", None, 0.25),
    ]
    assert detail.annotations[0].details == {"n": 1}
    with pytest.raises(NotFound):
        store.add_annotation("missing", AnnotationIn(call=0))


def test_an_older_sqlite_file_is_upgraded_and_read_only_readers_still_read_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)  # the tables as harnessrl wrote them before step rewards
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "CREATE TABLE rollouts (seq INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL UNIQUE,"
        " client_id TEXT NOT NULL UNIQUE, task_id TEXT NOT NULL, group_id TEXT, state TEXT NOT NULL,"
        " input TEXT NOT NULL, metadata TEXT NOT NULL, sampling TEXT NOT NULL, created_at REAL NOT NULL,"
        " updated_at REAL NOT NULL, n_attempts INTEGER NOT NULL DEFAULT 0);"
        "CREATE TABLE rewards (rollout_id TEXT PRIMARY KEY, value REAL NOT NULL, details TEXT NOT NULL,"
        " updated_at REAL NOT NULL);"
        "INSERT INTO rollouts (rollout_id, client_id, task_id, state, input, metadata, sampling, created_at,"
        " updated_at) VALUES ('old', 'old', 't', 'succeeded', '{}', '{}', '{}', 1.0, 1.0);"
        "INSERT INTO rewards VALUES ('old', 0.75, '{}', 1.0);"
    )
    db.commit()
    db.close()
    reader = SQLiteStore(path, readonly=True)  # a dashboard on an old run: nothing written
    old = reader.get_reward("old")
    assert old is not None and old.value == 0.75 and old.steps == [] and reader.annotations("old") == []
    reader.close()
    store = SQLiteStore(path)
    assert store.get_reward("old").steps == []  # type: ignore[union-attr]
    store.set_reward("old", RewardIn(value=1.0, steps=[StepReward(call=1, value=2.0)]))
    store.add_annotation("old", AnnotationIn(call=0, label="x"))
    store.close()
    again = SQLiteStore(path)
    assert again.detail("old").reward.steps == [StepReward(call=1, value=2.0)]  # type: ignore[union-attr]
    assert [a.label for a in again.annotations("old")] == ["x"]
    again.close()


def test_postgres_migration_2_upgrades_a_version_1_database(pg_url: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    from harnessrl.store.pg_schema import MIGRATIONS
    from harnessrl.store.postgres import PostgresStore

    with psycopg.connect(pg_url, autocommit=True) as conn:  # a database a version-1 harnessrl made
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
            " applied_at DOUBLE PRECISION NOT NULL)"
        )
        version, description, sql = MIGRATIONS[0]
        conn.execute(sql)
        conn.execute("INSERT INTO schema_migrations VALUES (%s, %s, 0)", (version, description))
        conn.execute(
            "INSERT INTO rollouts (seq, rollout_id, client_id, task_id, state, input, metadata, sampling,"
            " created_at, updated_at) VALUES (1, 'old', 'old', 't', 'queued', '{}', '{}', '{}', 1, 1)"
        )
        conn.execute("INSERT INTO rewards VALUES ('old', 0.5, '{}', 1)")
    store = PostgresStore(pg_url)
    try:
        assert store.migrations_applied == [v for v, _, _ in MIGRATIONS[1:]]
        old = store.get_reward("old")
        assert old is not None and old.value == 0.5 and old.steps == []
        store.set_reward("old", RewardIn(value=1.0, steps=[StepReward(tool_call_id="a", value=1.0)]))
        store.add_annotation("old", AnnotationIn(call=0, value=1.0))
        d = store.detail("old")
        assert d.reward is not None and d.reward.steps[0].tool_call_id == "a"
        assert d.annotations[0].value == 1.0
    finally:
        store.close()
