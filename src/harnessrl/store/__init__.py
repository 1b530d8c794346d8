"""Store: the durable record of rollouts, attempts, calls and rewards.

`open_store` picks the backend from how the store is named: a `postgresql://` (or `postgres://`) URL is
a PostgreSQL database (`store.postgres`), anything else the path of a SQLite file (`store.sqlite`).

Modules: `base` (the `Store` contract and its errors); `sql` (`SQLStore`: the methods whose SQL both
backends share) and `rows` (the columns they read, row -> model decoding); `sqlite` and `postgres` (the
two backends: transactions and locking, placeholders, numbering of rollouts, events and calls);
`pg_local` (a throwaway local PostgreSQL server for tests and demos).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harnessrl.store.base import Conflict, NotFound, Store, StoreError
from harnessrl.store.sqlite import SQLiteStore

__all__ = ["Conflict", "NotFound", "SQLiteStore", "Store", "StoreError", "is_postgres_url", "open_store"]


def is_postgres_url(spec: str | Path) -> bool:
    """Whether `spec` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(spec, str) and spec.startswith(("postgresql://", "postgres://"))


def open_store(spec: str | Path, **sqlite_options: Any) -> Store:
    """The store named by `spec`: a PostgreSQL URL or a SQLite file path (`sqlite_options` go to
    `SQLiteStore`: synchronous, wal_limit_mb...)."""
    if is_postgres_url(spec):
        from harnessrl.store.postgres import PostgresStore

        return PostgresStore(str(spec))
    return SQLiteStore(spec, **sqlite_options)
