"""The PostgreSQL store's schema: versioned migrations (table `schema_migrations`), applied at start under
an advisory lock so replicas starting together apply each one exactly once. The rollout state machine
is written into the database (`rollout_transitions` and a trigger)."""

from __future__ import annotations

import logging
from typing import Any

from harnessrl.schema import ROLLOUT_TRANSITIONS, AttemptStatus, RolloutState, now
from harnessrl.store.base import StoreError

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x6861726E  # pg_advisory_xact_lock key of the migrations ("harn")


def _transitions_sql() -> str:
    rows = ", ".join(
        f"('{a.value}', '{b.value}')" for a, targets in ROLLOUT_TRANSITIONS.items() for b in sorted(targets)
    )
    return f"INSERT INTO rollout_transitions (from_state, to_state) VALUES {rows};"


_STATES = ", ".join(f"'{s.value}'" for s in RolloutState)
_ATTEMPT_STATUSES = ", ".join(f"'{s.value}'" for s in AttemptStatus)

# Versioned schema migrations, applied in order at start; never edit one that has shipped: add the next.
MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "rollouts, attempts, calls, events, rewards, meta; the state machine as a table and triggers",
        f"""
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value BIGINT NOT NULL);
INSERT INTO counters (name, value) VALUES ('rollouts', 0), ('events', 0);
CREATE TABLE rollout_transitions (
  from_state TEXT NOT NULL, to_state TEXT NOT NULL, PRIMARY KEY (from_state, to_state)
);
{_transitions_sql()}
CREATE TABLE rollouts (
  seq BIGINT NOT NULL UNIQUE,
  rollout_id TEXT PRIMARY KEY,
  client_id TEXT NOT NULL UNIQUE,
  task_id TEXT NOT NULL,
  group_id TEXT,
  state TEXT NOT NULL CHECK (state IN ({_STATES})),
  input TEXT NOT NULL,
  metadata TEXT NOT NULL,
  sampling TEXT NOT NULL,
  created_at DOUBLE PRECISION NOT NULL,
  updated_at DOUBLE PRECISION NOT NULL,
  n_attempts INTEGER NOT NULL DEFAULT 0 CHECK (n_attempts >= 0)
);
CREATE INDEX rollouts_state ON rollouts (state, seq);
CREATE TABLE attempts (
  rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id),
  attempt INTEGER NOT NULL CHECK (attempt >= 0),
  status TEXT NOT NULL CHECK (status IN ({_ATTEMPT_STATUSES})),
  started_at DOUBLE PRECISION NOT NULL,
  ended_at DOUBLE PRECISION,
  exit_code INTEGER,
  error TEXT,
  PRIMARY KEY (rollout_id, attempt)
);
CREATE TABLE call_counters (rollout_id TEXT PRIMARY KEY, next_idx BIGINT NOT NULL);
CREATE TABLE calls (
  seq BIGSERIAL PRIMARY KEY,
  call_id TEXT NOT NULL UNIQUE,
  rollout_id TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  idx BIGINT NOT NULL,
  body TEXT NOT NULL,
  UNIQUE (rollout_id, idx)
);
CREATE TABLE events (
  seq BIGINT PRIMARY KEY,
  rollout_id TEXT NOT NULL,
  state TEXT NOT NULL,
  group_id TEXT,
  time DOUBLE PRECISION NOT NULL
);
CREATE TABLE rewards (
  rollout_id TEXT PRIMARY KEY REFERENCES rollouts (rollout_id),
  value DOUBLE PRECISION NOT NULL,
  details TEXT NOT NULL,
  updated_at DOUBLE PRECISION NOT NULL
);

CREATE FUNCTION harnessrl_check_transition() RETURNS trigger AS $$
BEGIN
  IF NEW.state IS DISTINCT FROM OLD.state AND NOT EXISTS (
      SELECT 1 FROM rollout_transitions WHERE from_state = OLD.state AND to_state = NEW.state) THEN
    RAISE EXCEPTION 'rollout cannot move from % to %', OLD.state, NEW.state
      USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER rollouts_transition BEFORE UPDATE OF state ON rollouts
  FOR EACH ROW EXECUTE FUNCTION harnessrl_check_transition();

CREATE FUNCTION harnessrl_check_attempt() RETURNS trigger AS $$
BEGIN
  IF NEW.status IS DISTINCT FROM OLD.status AND OLD.status <> 'running' THEN
    RAISE EXCEPTION 'attempt % of rollout % already ended as %', OLD.attempt, OLD.rollout_id, OLD.status
      USING ERRCODE = 'check_violation';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER attempts_status BEFORE UPDATE OF status ON attempts
  FOR EACH ROW EXECUTE FUNCTION harnessrl_check_attempt();
""",
    ),
    (
        2,
        "step rewards beside a rollout's reward; the harness's call annotations",
        """
ALTER TABLE rewards ADD COLUMN steps TEXT NOT NULL DEFAULT '[]';
CREATE TABLE annotations (
  seq BIGSERIAL PRIMARY KEY,
  rollout_id TEXT NOT NULL REFERENCES rollouts (rollout_id),
  created_at DOUBLE PRECISION NOT NULL,
  body TEXT NOT NULL
);
CREATE INDEX annotations_rollout ON annotations (rollout_id, seq);
""",
    ),
    (
        3,
        "the policy (several policies: the LoRA adapter) that served each call",
        """
ALTER TABLE calls ADD COLUMN policy TEXT;
""",
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(conn: Any) -> list[int]:
    """Apply the migrations `conn`'s database lacks, in order, each in its own transaction, under an
    advisory lock (replicas starting at once wait for each other). Returns the versions applied."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
            " description TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
        )
        done = {r[0] for r in conn.execute("SELECT version FROM schema_migrations").fetchall()}
        newest = max(done, default=0)
        if newest > SCHEMA_VERSION:
            raise StoreError(
                f"the database's schema is version {newest}, newer than this harnessrl's "
                f"({SCHEMA_VERSION}): upgrade harnessrl"
            )
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            with conn.transaction():  # a savepoint: a failing migration leaves nothing half-applied
                conn.execute(sql)
                conn.execute(
                    "INSERT INTO schema_migrations (version, description, applied_at) VALUES (%s, %s, %s)",
                    (version, description, now()),
                )
            applied.append(version)
            log.info("event=store_migrated version=%d description=%r", version, description)
    return applied
