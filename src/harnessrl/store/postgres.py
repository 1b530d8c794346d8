"""PostgreSQL store: the same `Store` contract as SQLite, for several gateways sharing one database.

Selected by a `postgresql://` URL wherever a store is named (`store:` in a run's config, `--store` of the
gateway). Driver: psycopg 3 with a connection pool (the `postgres` extra).

Guarantees, as SQLite's:
- every write commits before the method returns (`synchronous_commit` is the server's: `on` by default,
  so a committed call survives a crash of the gateway and of the server);
- creates are idempotent on `client_id`, also when two replicas create the same rollout at once
  (`INSERT ... ON CONFLICT DO NOTHING`, then the winner's row is read);
- the rollout state machine is enforced by the database itself: a trigger rejects any update of
  `rollouts.state` that `rollout_transitions` (the table of `schema.ROLLOUT_TRANSITIONS`) does not
  list, and an attempt that has ended cannot change its status, whatever client writes the row;
- cursors (`rollouts.seq`) and event sequence numbers (`events.seq`) are monotonic in commit order
  across replicas: they come from a counter row whose lock is held until commit, so a reader that has
  seen seq n never later finds a newly committed row below n (a plain sequence gives numbers in
  *start* order, and a slow transaction could commit a lower number after a reader moved past it);
- call indices are numbered within their rollout in the database (a counter row per rollout), so
  calls of one rollout written by different replicas never collide;
- a committed state change is announced with NOTIFY on `harnessrl_events`; `wait_events` LISTENs on
  a connection of its own, so a replica's event stream wakes on another replica's writes.

Schema migrations are versioned (`pg_schema.MIGRATIONS`, table `schema_migrations`) and applied at start
under an advisory lock, so replicas starting together apply each one exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from harnessrl.schema import (
    Call,
    Rollout,
    RolloutCreate,
    RolloutState,
    now,
)
from harnessrl.store.base import Conflict, NotFound, StoreError
from harnessrl.store.pg_schema import migrate
from harnessrl.store.rows import CALL_INSERT_COLS, ROLLOUT_COLS, call_row, dumps, to_rollout
from harnessrl.store.sql import SQLStore

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "harnessrl_events"


def _psycopg() -> Any:
    try:
        import psycopg
        import psycopg_pool
    except ImportError as e:  # pragma: no cover - depends on the install
        raise StoreError(
            "a postgresql:// store needs psycopg 3 and psycopg-pool: pip install 'harnessrl[postgres]'"
        ) from e
    return psycopg, psycopg_pool


class PostgresStore(SQLStore):
    """`Store` on a PostgreSQL database; safe to share between threads and between processes."""

    pushes_events = True  # LISTEN/NOTIFY: a write by another gateway replica wakes `wait_events`
    FOR_UPDATE = " FOR UPDATE"  # a row read and then changed stays locked until commit

    def __init__(self, url: str, pool_size: int = 4, connect_timeout_s: float = 10.0) -> None:
        psycopg, psycopg_pool = _psycopg()
        self.url = url
        self._psycopg = psycopg
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout_s)) as conn:
                self.migrations_applied = migrate(conn)
        except psycopg.OperationalError as e:
            raise StoreError(f"cannot reach the PostgreSQL store at {_redact(url)}: {e}") from e
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=max(pool_size, 1), open=True, name="harnessrl-store",
            kwargs={"autocommit": True}, timeout=connect_timeout_s,
        )  # fmt: skip
        self._pool.wait(timeout=connect_timeout_s)
        self._closed = False
        self._listen_lock = threading.Lock()
        self._listen_cond = threading.Condition()
        self._listener: threading.Thread | None = None
        self._listen_conn: Any = None
        self._notified = 0  # highest event seq announced on the channel so far

    # plumbing -------------------------------------------------------------------------------------
    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Any]:
        """A connection inside one transaction (committed on exit, rolled back on an exception); with
        `write=False` a single autocommit statement's connection (no BEGIN/COMMIT round trips).
        Database errors come out as `StoreError`s: a constraint or trigger as `Conflict`."""
        psycopg = self._psycopg
        try:
            with self._pool.connection() as conn, conn.transaction() if write else nullcontext():
                yield conn
        except psycopg.errors.CheckViolation as e:
            raise Conflict(_message(e)) from e
        except psycopg.errors.UniqueViolation as e:
            raise Conflict(_message(e)) from e
        except psycopg.errors.ForeignKeyViolation as e:
            raise NotFound(_message(e)) from e
        except psycopg.DataError as e:  # e.g. a NUL character in a text field
            raise StoreError(f"the store cannot hold this value: {_message(e)}") from e

    def _read(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        with self._tx(write=False) as conn:
            return list(conn.execute(sql, args).fetchall())

    def _q(self, sql: str) -> str:
        return sql.replace("?", "%s")  # psycopg's placeholders

    @staticmethod
    def _next(conn: Any, counter: str, n: int = 1) -> int:
        """Take `n` numbers from a counter; returns the last. The counter row stays locked until the
        transaction ends, so numbers are handed out in commit order (see the module docstring)."""
        row = conn.execute(
            "UPDATE counters SET value = value + %s WHERE name = %s RETURNING value", (n, counter)
        ).fetchone()
        return int(row[0])

    def _event(self, conn: Any, rollout_id: str, state: RolloutState, t: float) -> None:
        seq = self._next(conn, "events")
        conn.execute(
            "INSERT INTO events (seq, rollout_id, state, group_id, time)"
            " SELECT %s, rollout_id, %s, group_id, %s FROM rollouts WHERE rollout_id = %s",
            (seq, state.value, t, rollout_id),
        )
        conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, str(seq)))  # delivered at commit

    # rollouts -------------------------------------------------------------------------------------
    def create_rollout(self, req: RolloutCreate, rollout_id: str) -> tuple[Rollout, bool]:
        """Create a rollout, or return the existing one with the same `client_id`."""
        with self._tx() as conn:
            row = conn.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE client_id = %s", (req.client_id,)
            ).fetchone()
            if row is None:
                t = now()
                seq = self._next(conn, "rollouts")
                inserted = conn.execute(
                    "INSERT INTO rollouts (seq, rollout_id, client_id, task_id, group_id, state, input,"
                    " metadata, sampling, created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                    " ON CONFLICT (client_id) DO NOTHING RETURNING rollout_id",
                    (seq, rollout_id, req.client_id, req.task_id, req.group_id, RolloutState.QUEUED.value,
                     dumps(req.input), dumps(req.metadata), req.sampling.model_dump_json(), t, t),
                ).fetchone()  # fmt: skip
                if inserted is not None:
                    self._event(conn, rollout_id, RolloutState.QUEUED, t)
                    return self._get(conn, rollout_id), True
                # another replica created it meanwhile (ON CONFLICT waited for its commit): read it
                row = conn.execute(
                    f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE client_id = %s", (req.client_id,)
                ).fetchone()
            existing = to_rollout(row)
            if existing.task_id != req.task_id:
                raise Conflict(
                    f"client_id '{req.client_id}' already names a rollout of task '{existing.task_id}'"
                )
            return existing, False

    def wait_events(self, after: int, timeout_s: float) -> bool:
        """Block until an event after `after` is committed (by any process on this database) or
        `timeout_s` passes; returns whether one is there. Woken by LISTEN/NOTIFY, not by polling."""
        self._ensure_listener()
        deadline = time.monotonic() + timeout_s
        if self.events(after=after, limit=1):  # committed before this listener's LISTEN took effect
            return True
        with self._listen_cond:
            while self._notified <= after:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._listen_cond.wait(left)
        return bool(self.events(after=after, limit=1))

    def _ensure_listener(self) -> None:
        with self._listen_lock:
            if self._listener is not None:
                return
            conn = self._psycopg.connect(self.url, autocommit=True)
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._listen_conn = conn
            self._listener = threading.Thread(target=self._listen, name="pg-listen", daemon=True)
            self._listener.start()

    def _listen(self) -> None:
        conn = self._listen_conn
        try:
            while not self._closed:
                for note in conn.notifies(timeout=0.5):
                    with self._listen_cond:
                        self._notified = max(self._notified, int(note.payload))
                        self._listen_cond.notify_all()
        except Exception as e:
            if not self._closed:
                log.warning("event=pg_listener_stopped error=%s", e)
        finally:
            with self._listen_cond:
                self._listen_cond.notify_all()

    # calls ----------------------------------------------------------------------------------------
    def add_calls(self, calls: list[Call]) -> list[Call]:
        """Record calls in one transaction (group commit), each numbered within its rollout by the
        database (replicas writing calls of the same rollout never take the same index)."""
        if not calls:
            return calls
        for c in calls:  # a call that cannot be serialised fails the batch before anything is written
            c.model_dump_json()
        per_rollout: dict[str, int] = {}
        for c in calls:
            per_rollout[c.rollout_id] = per_rollout.get(c.rollout_id, 0) + 1
        indices = [c.index for c in calls]
        try:
            with self._tx() as conn:
                first: dict[str, int] = {}
                for rid in sorted(per_rollout):  # a fixed lock order: no deadlock between replicas
                    n = per_rollout[rid]
                    end = conn.execute(
                        "INSERT INTO call_counters (rollout_id, next_idx) VALUES (%s, %s)"
                        " ON CONFLICT (rollout_id) DO UPDATE SET next_idx = call_counters.next_idx + %s"
                        " RETURNING next_idx",
                        (rid, n, n),
                    ).fetchone()[0]
                    first[rid] = int(end) - n
                rows = []
                for c in calls:
                    c.index = first[c.rollout_id]
                    first[c.rollout_id] += 1
                    rows.append(call_row(c))
                with conn.cursor() as cur:
                    cur.executemany(
                        f"INSERT INTO calls ({CALL_INSERT_COLS}) VALUES (%s,%s,%s,%s,%s,%s)",
                        rows,
                    )
        except BaseException:
            for c, idx in zip(calls, indices, strict=True):
                c.index = idx
            raise
        return calls

    def schema_version(self) -> int:
        """The newest migration applied to the database."""
        return int(self._read("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")[0][0])

    def close(self) -> None:
        """Stop the listener and close the pool."""
        if self._closed:
            return
        self._closed = True
        with self._listen_cond:
            self._listen_cond.notify_all()
        if self._listener is not None:
            self._listener.join(timeout=5)
            self._listen_conn.close()
        self._pool.close()


def _message(e: Exception) -> str:
    diag = getattr(e, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    return str(primary or e).strip()


def _redact(url: str) -> str:
    """The URL without its password."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
