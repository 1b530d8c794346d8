"""The `Store` methods whose SQL the SQLite and the PostgreSQL store share, written once.

Both backends keep the same tables; what differs is how a transaction is opened (SQLite: `BEGIN
IMMEDIATE` under the store's lock; PostgreSQL: a pooled connection, rows locked `FOR UPDATE`), the
placeholder style (`?` as written here; `%s` for psycopg, by `_q`), how events are numbered, and the
methods that number things (`create_rollout`, `add_calls`). A backend subclasses `SQLStore` and gives
`_tx`, `_read` and `_event`; the statements below are the rest.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager
from typing import Any

from harnessrl.schema import (
    Annotation,
    AnnotationIn,
    Attempt,
    AttemptFinish,
    AttemptStatus,
    Call,
    InvalidTransition,
    Reward,
    RewardIn,
    Rollout,
    RolloutEvent,
    RolloutState,
    check_transition,
    now,
)
from harnessrl.store import rows
from harnessrl.store.base import Conflict, NotFound, Store

Row = rows.Row


class SQLStore(Store):
    """`Store` on SQL tables of `store.rows`'s columns; the backend gives the connection handling."""

    FOR_UPDATE = ""  # appended to a SELECT of rows the transaction goes on to change
    reward_cols = rows.REWARD_COLS  # a read-only store on an older file reads its rewards without steps
    keeps_annotations = True  # False on a read-only store whose older file has no annotations table

    @abstractmethod
    def _tx(self) -> AbstractContextManager[Any]:
        """A connection inside one write transaction (committed on exit, rolled back on an error)."""

    @abstractmethod
    def _read(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Row]:
        """The rows of one read-only statement (in the backend's placeholder style)."""

    @abstractmethod
    def _event(self, conn: Any, rollout_id: str, state: RolloutState, t: float) -> None:
        """Record that the rollout moved to `state` at `t` (inside the transaction of `conn`)."""

    def _q(self, sql: str) -> str:
        """The statement `sql`, written with `?` placeholders, in the backend's placeholder style."""
        return sql

    def _rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Row]:
        return self._read(self._q(sql), args)

    def query(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read-only SQL statement written with `?` placeholders (for views that the
        `Store` methods do not cover, e.g. the dashboard's), on any backend."""
        return [tuple(r) for r in self._rows(sql, args)]

    def _one(self, conn: Any, sql: str, args: tuple[Any, ...] = ()) -> Row | None:
        return conn.execute(self._q(sql), args).fetchone()

    def _state(self, conn: Any, rollout_id: str) -> tuple[RolloutState, int]:
        """The rollout's state and attempt count, its row locked for the transaction (or `NotFound`)."""
        row = self._one(
            conn,
            f"SELECT state, n_attempts FROM rollouts WHERE rollout_id = ?{self.FOR_UPDATE}",
            (rollout_id,),
        )
        if row is None:
            raise NotFound(f"rollout '{rollout_id}' not found")
        return RolloutState(row[0]), int(row[1])

    def _get(self, conn: Any, rollout_id: str) -> Rollout:
        row = self._one(conn, f"SELECT {rows.ROLLOUT_COLS} FROM rollouts WHERE rollout_id = ?", (rollout_id,))
        assert row is not None, rollout_id
        return rows.to_rollout(row)

    # rollouts -------------------------------------------------------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout | None:
        """The rollout, or None."""
        found = self._rows(f"SELECT {rows.ROLLOUT_COLS} FROM rollouts WHERE rollout_id = ?", (rollout_id,))
        return rows.to_rollout(found[0]) if found else None

    def list_rollouts(
        self, state: RolloutState | None = None, limit: int = 100, after: int = 0
    ) -> tuple[list[Rollout], int | None]:
        """Rollouts in creation order after cursor `after`; returns (page, next cursor or None)."""
        sql = f"SELECT {rows.ROLLOUT_COLS} FROM rollouts WHERE seq > ?"
        args: list[Any] = [after]
        if state is not None:
            sql += " AND state = ?"
            args.append(state.value)
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit + 1)
        return rows.rollout_page(self._rows(sql, args), limit)

    def set_state(self, rollout_id: str, state: RolloutState) -> Rollout:
        """Move a rollout to `state`, checking the transition table (a repeat of the same move is a no-op)."""
        with self._tx() as conn:
            current, _ = self._state(conn, rollout_id)
            if current != state:
                try:
                    check_transition(current, state)
                except InvalidTransition as e:
                    raise Conflict(str(e)) from e
                t = now()
                conn.execute(
                    self._q("UPDATE rollouts SET state = ?, updated_at = ? WHERE rollout_id = ?"),
                    (state.value, t, rollout_id),
                )
                self._event(conn, rollout_id, state, t)
            return self._get(conn, rollout_id)

    def events(self, after: int = 0, limit: int = 1000) -> list[RolloutEvent]:
        """State changes after sequence number `after`, oldest first."""
        found = self._rows(
            f"SELECT {rows.EVENT_COLS} FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)
        )
        return [rows.to_event(r) for r in found]

    # attempts -------------------------------------------------------------------------------------
    def start_attempt(self, rollout_id: str) -> Attempt:
        """Open the next attempt of a queued rollout and mark the rollout running."""
        with self._tx() as conn:
            current, n = self._state(conn, rollout_id)
            try:
                check_transition(current, RolloutState.RUNNING)
            except InvalidTransition as e:
                raise Conflict(f"cannot start an attempt: {e}") from e
            t = now()
            conn.execute(
                self._q("INSERT INTO attempts (rollout_id, attempt, status, started_at) VALUES (?,?,?,?)"),
                (rollout_id, n, AttemptStatus.RUNNING.value, t),
            )
            conn.execute(
                self._q("UPDATE rollouts SET state = ?, n_attempts = ?, updated_at = ? WHERE rollout_id = ?"),
                (RolloutState.RUNNING.value, n + 1, t, rollout_id),
            )
            self._event(conn, rollout_id, RolloutState.RUNNING, t)
        return Attempt(rollout_id=rollout_id, attempt=n, started_at=t)

    def finish_attempt(self, rollout_id: str, attempt: int, finish: AttemptFinish) -> Attempt:
        """Record how an attempt ended (a repeat of the same finish is a no-op)."""
        if finish.status == AttemptStatus.RUNNING:
            raise Conflict("an attempt cannot be finished with status 'running'")
        with self._tx() as conn:
            row = self._one(
                conn,
                f"SELECT status FROM attempts WHERE rollout_id = ? AND attempt = ?{self.FOR_UPDATE}",
                (rollout_id, attempt),
            )
            if row is None:
                raise NotFound(f"attempt {attempt} of rollout '{rollout_id}' not found")
            if row[0] == AttemptStatus.RUNNING.value:
                conn.execute(
                    self._q(
                        "UPDATE attempts SET status = ?, ended_at = ?, exit_code = ?, error = ?"
                        " WHERE rollout_id = ? AND attempt = ?"
                    ),
                    (finish.status.value, now(), finish.exit_code, finish.error, rollout_id, attempt),
                )
            elif row[0] != finish.status.value:
                raise Conflict(f"attempt {attempt} of rollout '{rollout_id}' already ended as {row[0]}")
        return next(a for a in self.attempts(rollout_id) if a.attempt == attempt)

    def attempts(self, rollout_id: str) -> list[Attempt]:
        """All attempts of a rollout, oldest first."""
        found = self._rows(
            f"SELECT {rows.ATTEMPT_COLS} FROM attempts WHERE rollout_id = ? ORDER BY attempt", (rollout_id,)
        )
        return [rows.to_attempt(r) for r in found]

    # calls ----------------------------------------------------------------------------------------
    def add_call(self, call: Call) -> Call:
        """Record one call, numbering it after the rollout's previous calls; durable on return."""
        return self.add_calls([call])[0]

    def calls(self, rollout_id: str) -> list[Call]:
        """All calls of a rollout in the order they were made."""
        found = self._rows(
            f"SELECT {rows.CALL_COLS} FROM calls WHERE rollout_id = ? ORDER BY idx, seq", (rollout_id,)
        )
        return [rows.to_call(r) for r in found]

    def recent_calls(self, rollout_id: str, limit: int) -> list[Call]:
        """The rollout's last `limit` calls, oldest first."""
        found = self._rows(
            f"SELECT {rows.CALL_COLS} FROM calls WHERE rollout_id = ? ORDER BY idx DESC, seq DESC LIMIT ?",
            (rollout_id, limit),
        )
        return [rows.to_call(r) for r in reversed(found)]

    def count_calls(self, rollout_id: str) -> int:
        """Number of calls recorded for a rollout."""
        return int(self._rows("SELECT COUNT(*) FROM calls WHERE rollout_id = ?", (rollout_id,))[0][0])

    # rewards --------------------------------------------------------------------------------------
    def set_reward(self, rollout_id: str, reward: RewardIn) -> Reward:
        """Write the rollout's reward; the last write wins."""
        t = now()
        with self._tx() as conn:
            self._state(conn, rollout_id)
            conn.execute(
                self._q(
                    "INSERT INTO rewards (rollout_id, value, details, updated_at, steps) VALUES (?,?,?,?,?)"
                    " ON CONFLICT (rollout_id) DO UPDATE SET value = excluded.value,"
                    " details = excluded.details, updated_at = excluded.updated_at, steps = excluded.steps"
                ),
                (rollout_id, reward.value, rows.dumps(reward.details), t, rows.steps_json(reward.steps)),
            )
        return Reward(rollout_id=rollout_id, value=reward.value, details=reward.details,
                      steps=list(reward.steps), updated_at=t)  # fmt: skip

    def get_reward(self, rollout_id: str) -> Reward | None:
        """The rollout's reward, or None."""
        found = self._rows(f"SELECT {self.reward_cols} FROM rewards WHERE rollout_id = ?", (rollout_id,))
        return rows.to_reward(rollout_id, found[0]) if found else None

    # annotations ----------------------------------------------------------------------------------
    def add_annotation(self, rollout_id: str, annotation: AnnotationIn) -> Annotation:
        """Record the harness's annotation of one of its calls; durable on return."""
        t = now()
        body = annotation.model_dump_json(exclude_defaults=True)
        with self._tx() as conn:
            self._state(conn, rollout_id)
            row = self._one(
                conn,
                "INSERT INTO annotations (rollout_id, created_at, body) VALUES (?,?,?) RETURNING seq",
                (rollout_id, t, body),
            )
        assert row is not None
        return rows.to_annotation((row[0], rollout_id, t, body))

    def annotations(self, rollout_id: str) -> list[Annotation]:
        """The rollout's annotations in the order they were written."""
        if not self.keeps_annotations:
            return []
        found = self._rows(
            f"SELECT {rows.ANNOTATION_COLS} FROM annotations WHERE rollout_id = ? ORDER BY seq", (rollout_id,)
        )
        return [rows.to_annotation(r) for r in found]

    # meta -----------------------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        """A store-level setting."""
        found = self._rows("SELECT value FROM meta WHERE key = ?", (key,))
        return str(found[0][0]) if found else None

    def set_meta(self, key: str, value: str) -> None:
        """Set a store-level setting (the last write wins)."""
        with self._tx() as conn:
            conn.execute(
                self._q(
                    "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = ?"
                ),
                (key, value, value),
            )

    def set_meta_if_absent(self, key: str, value: str) -> str:
        """Set a store-level setting unless present; returns the stored value (the first writer's,
        when writers race)."""
        with self._tx() as conn:
            conn.execute(
                self._q("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"),
                (key, value),
            )
            row = self._one(conn, "SELECT value FROM meta WHERE key = ?", (key,))
            assert row is not None, key
            return str(row[0])
