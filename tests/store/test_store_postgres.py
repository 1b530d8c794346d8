"""What the PostgreSQL store guarantees beyond the shared store suite: versioned migrations, the state
machine enforced by the database itself, idempotent creates and call numbering across replicas (several
store instances on one database), event numbers in commit order, LISTEN/NOTIFY wake-ups, clear errors.
Against a real PostgreSQL server started by the session (tests/support/store_fixtures.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harnessrl.schema import (
    ROLLOUT_TRANSITIONS,
    AttemptFinish,
    AttemptStatus,
    Call,
    CallStatus,
    RolloutCreate,
    RolloutState,
    now,
)
from harnessrl.store import StoreError, open_store
from harnessrl.store.pg_schema import MIGRATIONS, SCHEMA_VERSION
from harnessrl.store.postgres import PostgresStore

psycopg = pytest.importorskip("psycopg", reason="the postgres extra is not installed")


def _call(rid: str, cid: str) -> Call:
    return Call(call_id=cid, rollout_id=rid, attempt=0, created_at=now(), latency_s=0.0, status=CallStatus.OK,
                model="m", upstream="u", request={"messages": [{"role": "user", "content": cid}]})  # fmt: skip


def test_migrations_are_versioned_and_applied_once(pg_url: str) -> None:
    first = PostgresStore(pg_url)
    assert (
        first.migrations_applied == [v for v, _, _ in MIGRATIONS] and first.schema_version() == SCHEMA_VERSION
    )
    second = open_store(pg_url)
    assert isinstance(second, PostgresStore) and second.migrations_applied == []
    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT version, description FROM schema_migrations ORDER BY version").fetchall()
    assert [r[0] for r in rows] == [v for v, _, _ in MIGRATIONS] and all(r[1] for r in rows)
    first.close()
    second.close()


def test_replicas_starting_together_migrate_once(pg_url: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresStore(pg_url), range(4)))
    assert sorted(len(s.migrations_applied) for s in stores) == [0, 0, 0, len(MIGRATIONS)]
    for s in stores:
        s.close()


def test_a_newer_schema_is_refused(pg_url: str) -> None:
    PostgresStore(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES (%s, 'from the future', 0)", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match="newer than this harnessrl"):
        PostgresStore(pg_url)


def test_the_database_enforces_the_state_machine(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    store.create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")
    store.start_attempt("r")
    store.finish_attempt("r", 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))
    store.set_state("r", RolloutState.SUCCEEDED)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        table = {(a, b) for a, b in conn.execute("SELECT from_state, to_state FROM rollout_transitions")}
        assert table == {(a.value, b.value) for a, bs in ROLLOUT_TRANSITIONS.items() for b in bs}
        # a client going around the store (another tool, a bug) cannot break the machine either
        with pytest.raises(psycopg.errors.CheckViolation, match="cannot move from succeeded to running"):
            conn.execute("UPDATE rollouts SET state = 'running' WHERE rollout_id = 'r'")
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("UPDATE rollouts SET state = 'bogus' WHERE rollout_id = 'r'")
        with pytest.raises(psycopg.errors.CheckViolation, match="already ended as exited"):
            conn.execute("UPDATE attempts SET status = 'running' WHERE rollout_id = 'r'")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute(
                "INSERT INTO attempts (rollout_id, attempt, status, started_at) VALUES ('nope', 0, 'running', 0)"
            )
        conn.execute("UPDATE rollouts SET updated_at = 1 WHERE rollout_id = 'r'")  # other columns: fine
    assert store.get_rollout("r").state == RolloutState.SUCCEEDED  # type: ignore[union-attr]
    store.close()


def test_replicas_create_each_rollout_once(pg_url: str) -> None:
    replicas = [PostgresStore(pg_url) for _ in range(2)]

    def create(n: int) -> list[tuple[str, str, bool]]:
        store = replicas[n % 2]
        out = []
        for i in range(15):
            ro, created = store.create_rollout(RolloutCreate(client_id=f"c{i}", task_id="t"), f"r{i}-{n}")
            out.append((ro.client_id, ro.rollout_id, created))
        return out

    with ThreadPoolExecutor(6) as pool:
        results = [r for chunk in pool.map(create, range(6)) for r in chunk]
    ids: dict[str, set[str]] = {}
    for client_id, rollout_id, _ in results:
        ids.setdefault(client_id, set()).add(rollout_id)
    assert all(len(v) == 1 for v in ids.values()), "a client_id got two rollouts"
    assert sum(created for _, _, created in results) == 15
    page, _ = replicas[0].list_rollouts(limit=100)
    assert len(page) == 15
    assert sum(e.state == RolloutState.QUEUED for e in replicas[1].events()) == 15
    for s in replicas:
        s.close()


def test_replicas_number_calls_of_one_rollout_without_collision(pg_url: str) -> None:
    replicas = [PostgresStore(pg_url) for _ in range(2)]
    replicas[0].create_rollout(RolloutCreate(client_id="c", task_id="t"), "r")

    def write(n: int) -> None:
        for j in range(10):
            replicas[n % 2].add_calls([_call("r", f"w{n}-{j}-{k}") for k in range(3)])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    calls = replicas[1].calls("r")
    assert [c.index for c in calls] == list(range(120))
    assert len({c.call_id for c in calls}) == 120
    for s in replicas:
        s.close()


def test_event_cursor_never_skips_an_event_under_concurrent_replicas(pg_url: str) -> None:
    """A reader following `events(after=cursor)` while two replicas write sees every event: numbers are
    handed out in commit order, so nothing commits below a cursor already passed."""
    replicas = [PostgresStore(pg_url) for _ in range(2)]
    reader = PostgresStore(pg_url)
    stop = threading.Event()
    seen: list[int] = []

    def follow() -> None:
        cursor = 0
        while True:
            done = stop.is_set()
            batch = reader.events(after=cursor, limit=1000)
            seen.extend(e.seq for e in batch)
            cursor = batch[-1].seq if batch else cursor
            if done and not batch:
                return

    def write(n: int) -> None:
        store = replicas[n % 2]
        for i in range(12):
            rid = f"r{n}-{i}"
            store.create_rollout(RolloutCreate(client_id=rid, task_id="t"), rid)
            store.start_attempt(rid)
            store.set_state(rid, RolloutState.SUCCEEDED)

    t = threading.Thread(target=follow)
    t.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))
    stop.set()
    t.join(60)
    everything = [e.seq for e in reader.events(limit=10_000)]
    assert len(everything) == 4 * 12 * 3
    assert seen == everything, f"the follower missed {len(set(everything) - set(seen))} events"
    for s in [*replicas, reader]:
        s.close()


def test_listen_notify_wakes_a_waiter_on_another_replicas_write(pg_url: str) -> None:
    waiter, writer = PostgresStore(pg_url), PostgresStore(pg_url)
    writer.create_rollout(RolloutCreate(client_id="c0", task_id="t"), "r0")
    last = writer.events()[-1].seq
    result: dict[str, float | bool] = {}

    def wait() -> None:
        t0 = time.monotonic()
        result["woke"] = waiter.wait_events(after=last, timeout_s=20)
        result["after_s"] = time.monotonic() - t0

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.5)
    written = time.monotonic()
    writer.create_rollout(RolloutCreate(client_id="c1", task_id="t"), "r1")
    t.join(30)
    assert result["woke"] is True
    latency = float(result["after_s"]) - 0.5
    assert latency < 2.0, f"woke {latency:.2f} s after the write (a poll, not a notification?)"
    assert time.monotonic() - written < 5
    waiter.close()
    writer.close()


def test_bad_values_and_unreachable_servers_are_clear_errors(pg_url: str, pg_server: object) -> None:
    store = PostgresStore(pg_url)
    with pytest.raises(StoreError, match="cannot hold this value"):  # PostgreSQL text holds no NUL
        store.create_rollout(RolloutCreate(client_id="bad\x00id", task_id="t"), "r")
    assert store.list_rollouts()[0] == []  # nothing half-written; the store still works
    assert store.create_rollout(RolloutCreate(client_id="ok", task_id="t"), "r")[1]
    store.close()
    port = pg_url.rsplit(":", 1)[1].split("/")[0]
    dead = pg_url.replace(f"harnessrl@127.0.0.1:{port}", "harnessrl:hunter2@127.0.0.1:1")
    with pytest.raises(StoreError, match="cannot reach the PostgreSQL store") as info:
        PostgresStore(dead, connect_timeout_s=2)
    assert "hunter2" not in str(info.value)


def test_an_event_number_taken_by_an_open_transaction_holds_later_writers_back(pg_url: str) -> None:
    """The mechanism behind commit-ordered numbers, forced: while one transaction holds an event number
    it has not committed, another replica's write waits, so no reader can see a higher number first."""
    store, reader = PostgresStore(pg_url), PostgresStore(pg_url)
    store.create_rollout(RolloutCreate(client_id="a", task_id="t"), "ra")
    done = threading.Event()
    with psycopg.connect(pg_url) as slow:  # a replica in the middle of its transaction
        seq = slow.execute(
            "UPDATE counters SET value = value + 1 WHERE name = 'events' RETURNING value"
        ).fetchone()
        writer = threading.Thread(
            target=lambda: (store.set_state("ra", RolloutState.CANCELLED), done.set()), daemon=True
        )
        writer.start()
        time.sleep(0.5)
        assert not done.is_set(), "a later writer committed while a lower event number was still open"
        assert [e.seq for e in reader.events()] == [1]
        slow.execute(
            "INSERT INTO events (seq, rollout_id, state, group_id, time) VALUES (%s, 'ra', 'running', NULL, 0)",
            (seq[0],),  # type: ignore[index]
        )
        slow.commit()
    writer.join(10)
    assert done.is_set()
    assert [e.seq for e in reader.events()] == [1, 2, 3]
    store.close()
    reader.close()
