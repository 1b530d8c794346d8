"""The policy of every call (several policies in one run) in both stores: in the call's record and in
the `policy` column (SQL can select by it); a SQLite file written before the column gets it at open,
a PostgreSQL database by migration 3."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from harnessrl.schema import Call, CallStatus, RolloutCreate
from harnessrl.store import SQLiteStore, Store


def _call(rid: str, n: int, policy: str | None) -> Call:
    return Call(call_id=f"c{rid}{n}", rollout_id=rid, attempt=0, created_at=1.0, latency_s=0.1,
                status=CallStatus.OK, model=policy or "smollm2", upstream="engine0", request={},
                prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5], weight_version=n,
                policy=policy)  # fmt: skip


def _policies_by_sql(store: Store) -> list[tuple[str, str | None]]:
    if isinstance(store, SQLiteStore):
        db = sqlite3.connect(store.path)
        try:
            return db.execute("SELECT call_id, policy FROM calls ORDER BY seq").fetchall()
        finally:
            db.close()
    import psycopg

    with psycopg.connect(store.url) as conn:  # type: ignore[attr-defined]
        return [tuple(r) for r in conn.execute("SELECT call_id, policy FROM calls ORDER BY seq").fetchall()]


def test_the_policy_of_each_call_is_stored_and_read_back(store: Store) -> None:
    store.create_rollout(RolloutCreate(client_id="r", task_id="t"), "r")
    store.add_call(_call("r", 0, "planner"))
    store.add_calls([_call("r", 1, "solver"), _call("r", 2, None)])
    calls = store.detail("r").calls
    assert [(c.policy, c.weight_version) for c in calls] == [("planner", 0), ("solver", 1), (None, 2)]
    assert _policies_by_sql(store) == [("cr0", "planner"), ("cr1", "solver"), ("cr2", None)]


def test_an_sqlite_file_without_the_policy_column_gets_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    SQLiteStore(path).close()
    db = sqlite3.connect(path)  # the calls table as harnessrl wrote it before policies
    db.executescript(
        "DROP TABLE calls; CREATE TABLE calls (seq INTEGER PRIMARY KEY AUTOINCREMENT, call_id TEXT NOT NULL"
        " UNIQUE, rollout_id TEXT NOT NULL, attempt INTEGER NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL);"
    )
    db.commit()
    db.close()
    store = SQLiteStore(path)
    store.create_rollout(RolloutCreate(client_id="r", task_id="t"), "r")
    store.add_call(_call("r", 0, "planner"))
    assert store.detail("r").calls[0].policy == "planner"
    assert _policies_by_sql(store) == [("cr0", "planner")]
    store.close()


def test_postgres_migration_3_adds_the_policy_column(pg_url: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    from harnessrl.store.pg_schema import MIGRATIONS
    from harnessrl.store.postgres import PostgresStore

    with psycopg.connect(pg_url, autocommit=True) as conn:  # a database a version-2 harnessrl made
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
            " applied_at DOUBLE PRECISION NOT NULL)"
        )
        for version, description, sql in MIGRATIONS[:2]:
            conn.execute(sql)
            conn.execute("INSERT INTO schema_migrations VALUES (%s, %s, 0)", (version, description))
    store = PostgresStore(pg_url)
    try:
        assert store.migrations_applied == [3]
        store.create_rollout(RolloutCreate(client_id="r", task_id="t"), "r")
        store.add_call(_call("r", 0, "solver"))
        assert store.detail("r").calls[0].policy == "solver"
        assert _policies_by_sql(store) == [("cr0", "solver")]
    finally:
        store.close()
