"""SQLite store in WAL mode: the embedded default, a single file.

Durability: every write commits before the method returns. With `synchronous=NORMAL` (the default) a
committed write survives a crash or `kill -9` of the process; `synchronous=FULL` also survives power
loss at the price of an fsync per commit.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from harnessrl.defaults import WAL_LIMIT_MB
from harnessrl.schema import (
    Call,
    Rollout,
    RolloutCreate,
    RolloutDetail,
    RolloutState,
    now,
)
from harnessrl.store.base import Conflict
from harnessrl.store.rows import CALL_INSERT_COLS, ROLLOUT_COLS, call_row, dumps, steps_json, to_rollout
from harnessrl.store.sql import SQLStore

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rollouts (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  rollout_id TEXT NOT NULL UNIQUE,
  client_id TEXT NOT NULL UNIQUE,
  task_id TEXT NOT NULL,
  group_id TEXT,
  state TEXT NOT NULL,
  input TEXT NOT NULL,
  metadata TEXT NOT NULL,
  sampling TEXT NOT NULL,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL,
  n_attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts (state, seq);
CREATE TABLE IF NOT EXISTS attempts (
  rollout_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  status TEXT NOT NULL,
  started_at REAL NOT NULL,
  ended_at REAL,
  exit_code INTEGER,
  error TEXT,
  PRIMARY KEY (rollout_id, attempt)
);
-- calls.seq is the rowid without AUTOINCREMENT (calls are never deleted, so it never goes back):
-- AUTOINCREMENT rewrote sqlite_sequence's page in every commit, one WAL page of ~5 per call.
-- Files made before keep their AUTOINCREMENT; both number calls the same way.
CREATE TABLE IF NOT EXISTS calls (
  seq INTEGER PRIMARY KEY,
  call_id TEXT NOT NULL UNIQUE,
  rollout_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  idx INTEGER NOT NULL,
  body TEXT NOT NULL,
  policy TEXT
);
CREATE INDEX IF NOT EXISTS calls_rollout ON calls (rollout_id, idx);
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  rollout_id TEXT NOT NULL,
  state TEXT NOT NULL,
  group_id TEXT,
  time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rewards (
  rollout_id TEXT PRIMARY KEY,
  value REAL NOT NULL,
  details TEXT NOT NULL,
  updated_at REAL NOT NULL,
  steps TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS annotations (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  rollout_id TEXT NOT NULL,
  created_at REAL NOT NULL,
  body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS annotations_rollout ON annotations (rollout_id, seq);
"""
# Columns added after a file was first created, with their definitions: `_upgrade` adds the ones an
# older store file lacks (SQLite keeps no migration table: a column's presence is its version).
_ADDED_COLUMNS = {("rewards", "steps"): "TEXT NOT NULL DEFAULT '[]'", ("calls", "policy"): "TEXT"}


def _upgrade(db: sqlite3.Connection) -> None:
    """Bring a store file written by an older harnessrl to the current tables (see `_ADDED_COLUMNS`)."""
    for (table, column), definition in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            log.info("event=store_upgraded table=%s column=%s", table, column)


# How often the WAL is folded in and started over (besides when it passes a quarter of its limit):
# every look at it. Small folds keep the fold's hold on the writers short (its fsyncs cost about as
# much as the pages they flush), and the WAL file is not cut back when it starts over
# (`journal_size_limit` is the whole limit), so its writes reuse blocks already allocated instead of
# allocating new ones that every journal commit of the file system must flush first. Folding every
# 5 s with the file cut back to a quarter made the gateway's p99 at one client grow with the store
# (3 -> 18 ms over 60 s of load at ~28 MB/s of WAL; issue 35, docs/reliability.md).
CHECKPOINT_EVERY_S = 0.25
WAL_POLL_S = 0.25  # how often the checkpointer looks at the WAL's size
FOLD_PASSES = 4  # PASSIVE checkpoints beside the writers before the one that holds them back (`_fold`)
FOLD_LOCKED_FRAMES = 64  # ... unless the last copied no more frames than this
TRUNCATE_BUSY_MS = 200
TRUNCATE_RETRY_S = 2.0  # after readers blocked a TRUNCATE, PASSIVE checkpoints only for this long
BUSY_TIMEOUT_MS = 10_000  # how long a TRUNCATE checkpoint waits for readers of other processes


class SQLiteStore(SQLStore):
    """`Store` on one SQLite file in WAL mode; safe to share between threads of one process."""

    def __init__(
        self,
        path: str | Path,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
        wal_limit_mb: float = WAL_LIMIT_MB,
        readonly: bool = False,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        if readonly:  # a reader beside the run's writer (the dashboard): no schema, no checkpoints
            self._open_readonly()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if (
            not self.path.exists()
        ):  # 0600: the store holds the key secret (SQLite gives -wal/-shm the same mode)
            os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        self.wal_limit_bytes = int(wal_limit_mb * 2**20)
        self._wal = Path(f"{self.path}-wal")
        self._lock = threading.RLock()
        # Held by a checkpoint that runs beside the writers (the first of `_fold`), so the writer's
        # TRUNCATE (`_bound_wal`) waits for it instead of finding SQLite busy and giving up for a while.
        self._checkpointing = threading.Lock()
        self._next_idx: dict[str, int] = {}  # this process is the only writer of calls
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        # When a commit starts the WAL over (after `_fold`), SQLite would cut the file back to this:
        # the whole limit, so the WAL's blocks stay allocated (see CHECKPOINT_EVERY_S).
        self._db.execute(f"PRAGMA journal_size_limit={self.wal_limit_bytes}")
        self._db.executescript(_SCHEMA)
        _upgrade(self._db)
        # Checkpoints (copying the WAL into the database file, with an fsync) run on a thread of their
        # own, so no commit on a request path ever waits for one (see `_checkpoint_loop`).
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._stop = threading.Event()
        self.wal_truncations = 0
        self.wal_folds = 0  # second, catching-up checkpoints of `_fold`
        self._truncate_after = 0.0  # no TRUNCATE before this instant (readers blocked the last one)
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, args=(checkpoint_every_s,), name="sqlite-checkpoint", daemon=True
        )
        self._checkpointer.start()

    def _open_readonly(self) -> None:
        """Open the file with SQLite's read-only mode: every write fails, nothing is created."""
        if not self.path.is_file():
            raise FileNotFoundError(f"no store at {self.path}")
        self._lock = threading.RLock()
        self._next_idx = {}
        self._stop = threading.Event()
        self._stop.set()  # nothing to stop or fold in on close
        self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                   check_same_thread=False, isolation_level=None)  # fmt: skip
        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._db.execute("SELECT COUNT(*) FROM rollouts").fetchone()  # fails now on a file that is no store
        if "steps" not in {row[1] for row in self._db.execute("PRAGMA table_info(rewards)")}:
            self.reward_cols = "value, details, updated_at, '[]'"  # a file from before step rewards
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        self.keeps_annotations = "annotations" in tables

    def query(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read-only SQL statement (for views that the `Store` methods do not cover)."""
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    _read = query

    def import_detail(self, detail: RolloutDetail) -> None:
        """Insert a rollout recorded elsewhere (an exported trace) as it was: ids, times, attempts,
        calls with their indexes, reward. A rollout or call id already stored is a `Conflict`."""
        r = detail.rollout
        with self._tx() as db:
            if db.execute(
                "SELECT 1 FROM rollouts WHERE rollout_id = ? OR client_id = ?", (r.rollout_id, r.client_id)
            ).fetchone():
                raise Conflict(f"rollout '{r.rollout_id}' (client_id '{r.client_id}') is already stored")
            db.execute(
                "INSERT INTO rollouts (rollout_id, client_id, task_id, group_id, state, input, metadata,"
                " sampling, created_at, updated_at, n_attempts) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (r.rollout_id, r.client_id, r.task_id, r.group_id, r.state.value, dumps(r.input),
                 dumps(r.metadata), r.sampling.model_dump_json(), r.created_at, r.updated_at, r.n_attempts),
            )  # fmt: skip
            db.executemany(
                "INSERT INTO attempts (rollout_id, attempt, status, started_at, ended_at, exit_code, error)"
                " VALUES (?,?,?,?,?,?,?)",
                [(r.rollout_id, a.attempt, a.status.value, a.started_at, a.ended_at, a.exit_code, a.error)
                 for a in detail.attempts],
            )  # fmt: skip
            for c in detail.calls:
                if db.execute("SELECT 1 FROM calls WHERE call_id = ?", (c.call_id,)).fetchone():
                    raise Conflict(f"call '{c.call_id}' is already stored")
            db.executemany(
                f"INSERT INTO calls ({CALL_INSERT_COLS}) VALUES (?,?,?,?,?,?)",
                [
                    (c.call_id, r.rollout_id, c.attempt, c.index, c.model_dump_json(), c.policy)
                    for c in detail.calls
                ],
            )
            db.execute(
                "INSERT INTO events (rollout_id, state, group_id, time) VALUES (?,?,?,?)",
                (r.rollout_id, r.state.value, r.group_id, r.updated_at),
            )
            if detail.reward is not None:
                w = detail.reward
                db.execute(
                    "INSERT INTO rewards (rollout_id, value, details, updated_at, steps) VALUES (?,?,?,?,?)",
                    (r.rollout_id, w.value, dumps(w.details), w.updated_at, steps_json(w.steps)),
                )
            db.executemany(
                "INSERT INTO annotations (rollout_id, created_at, body) VALUES (?,?,?)",
                [(r.rollout_id, a.created_at, a.model_dump_json()) for a in detail.annotations],
            )
        self._next_idx.pop(r.rollout_id, None)

    def _checkpoint_loop(self, every_s: float) -> None:
        """Every `WAL_POLL_S`: TRUNCATE the WAL if it passed half its limit all the same (`_truncate`;
        a reader of another connection that holds an old snapshot keeps SQLite from starting the WAL
        over, so it can grow while one does); else fold it in (`_fold`) every `every_s`, or sooner
        once the file passes a quarter of its limit."""
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout={TRUNCATE_BUSY_MS}")
        tick = min(every_s, WAL_POLL_S)
        last_fold = time.monotonic()
        try:
            while not self._stop.wait(tick):
                try:
                    size = self._wal.stat().st_size
                except FileNotFoundError:
                    size = 0
                if size > self.wal_limit_bytes // 2 and time.monotonic() >= self._truncate_after:
                    self._truncate(db, size)
                elif size > self.wal_limit_bytes // 4 or time.monotonic() - last_fold >= every_s:
                    self._fold(db)
                    last_fold = time.monotonic()
        except sqlite3.Error:
            log.exception("event=checkpointer_stopped path=%s", self.path)
        finally:
            db.close()

    def _fold(self, db: sqlite3.Connection) -> None:
        """PASSIVE checkpoints beside the writers copy the WAL into the file and do the fsyncs, again
        while the last one copied more than `FOLD_LOCKED_FRAMES` frames (at most `FOLD_PASSES`);
        then one more, holding the writers back (the store's lock), copies what commits added
        meanwhile, so the WAL is all folded in with no commit under way and the next commit starts it
        over from its beginning.

        Without the locked one, a writer that commits back to back always has a commit under way when
        a checkpoint ends: the WAL never starts over and grows until a TRUNCATE, which holds the
        writers (and the gateway's event loop, which commits) for the copy of the whole WAL and its
        fsync, tens to hundreds of milliseconds every few seconds at concurrency 1. The catching-up
        passes keep the locked one short: its fsyncs cost about as much as the pages it copies (~17 ms
        for a thousand on the machine of docs/benchmarks.md), and the writers wait for all of it
        (issue 35)."""
        with self._checkpointing:
            _, frames, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if frames <= 0:
                return  # the WAL is empty, or was started over since the last fold
            for _ in range(FOLD_PASSES - 1):
                _, frames, now = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                copied, done = now - done, now
                if copied == 0 and now == frames:
                    return  # nothing came in since the last pass: all folded in, no writer to hold
                if copied <= FOLD_LOCKED_FRAMES:  # (negative: the WAL started over meanwhile)
                    break
        with self._lock:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.wal_folds += 1

    def _truncate(self, db: sqlite3.Connection, size: int) -> None:
        """Fold the WAL in and empty it, holding this process's writers back (the store's lock, which
        they wait on without sleeping in SQLite's busy handler). A reader of another connection that
        holds an old snapshot blocks it: it then gives up after `TRUNCATE_BUSY_MS` and is tried again
        `TRUNCATE_RETRY_S` later, so writers never wait on such readers for long."""
        with self._lock:
            busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            self._truncated(busy)
        log.info("event=wal_truncate size_mb=%.1f busy=%d", size / 2**20, busy)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # rollouts -------------------------------------------------------------------------------------
    def create_rollout(self, req: RolloutCreate, rollout_id: str) -> tuple[Rollout, bool]:
        """Create a rollout, or return the existing one with the same `client_id`."""
        with self._tx() as db:
            row = db.execute(
                f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE client_id = ?", (req.client_id,)
            ).fetchone()
            if row is not None:
                existing = to_rollout(row)
                if existing.task_id != req.task_id:
                    raise Conflict(
                        f"client_id '{req.client_id}' already names a rollout of task '{existing.task_id}'"
                    )
                return existing, False
            t = now()
            db.execute(
                "INSERT INTO rollouts (rollout_id, client_id, task_id, group_id, state, input, metadata,"
                " sampling, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    rollout_id,
                    req.client_id,
                    req.task_id,
                    req.group_id,
                    RolloutState.QUEUED.value,
                    dumps(req.input),
                    dumps(req.metadata),
                    req.sampling.model_dump_json(),
                    t,
                    t,
                ),
            )
            self._event(db, rollout_id, RolloutState.QUEUED, t)
            return self._get(db, rollout_id), True

    def _event(self, db: sqlite3.Connection, rollout_id: str, state: RolloutState, t: float) -> None:
        db.execute(
            "INSERT INTO events (rollout_id, state, group_id, time)"
            " SELECT rollout_id, ?, group_id, ? FROM rollouts WHERE rollout_id = ?",
            (state.value, t, rollout_id),
        )

    # calls ----------------------------------------------------------------------------------------
    def add_calls(self, calls: list[Call]) -> list[Call]:
        """Record calls in one transaction (group commit), each numbered within its rollout."""
        with self._lock:
            try:  # a call that cannot be serialised fails the batch before anything is written
                rows = []
                for call in calls:
                    idx = self._next_idx.get(call.rollout_id)
                    if idx is None:  # first call of this rollout seen by this process: ask the file
                        idx = self._db.execute(
                            "SELECT COALESCE(MAX(idx) + 1, 0) FROM calls WHERE rollout_id = ?",
                            (call.rollout_id,),
                        ).fetchone()[0]
                    call.index = int(idx)
                    self._next_idx[call.rollout_id] = call.index + 1
                    rows.append(call_row(call))
                with self._tx() as db:
                    db.executemany(f"INSERT INTO calls ({CALL_INSERT_COLS}) VALUES (?,?,?,?,?,?)", rows)
            except BaseException:
                self._next_idx.clear()  # numbering must be re-read after a failed write
                raise
            self._bound_wal()
            if len(self._next_idx) > 100_000:
                self._next_idx.clear()
        return calls

    def _bound_wal(self) -> None:
        """The backstop of `_checkpoint_loop`: when the checkpointer has fallen behind and the WAL
        passes 3/4 of its limit, the writer empties it itself (the caller holds the lock)."""
        try:
            size = os.stat(self._wal).st_size
        except FileNotFoundError:
            return
        if size <= self.wal_limit_bytes * 3 // 4 or time.monotonic() < self._truncate_after:
            return
        self._db.execute(f"PRAGMA busy_timeout={TRUNCATE_BUSY_MS}")
        try:
            with self._checkpointing:
                busy = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        finally:
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._truncated(busy)
        log.warning("event=wal_truncate_inline size_mb=%.1f busy=%d", size / 2**20, busy)

    def _truncated(self, busy: int) -> None:
        """Count a TRUNCATE; after one that readers blocked, wait `TRUNCATE_RETRY_S` before the next."""
        self.wal_truncations += not busy
        if busy:
            self._truncate_after = time.monotonic() + TRUNCATE_RETRY_S

    def close(self) -> None:
        """Stop the checkpointer, fold the WAL into the file, empty it and close the connection."""
        if self._stop.is_set():
            if self.readonly:
                self._db.close()
            return  # closed already (a read-only store has nothing to fold in)
        self._stop.set()
        self._checkpointer.join(timeout=30)
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                self._db.close()
