"""Store fixtures for both backends: SQLite files, and databases on a real PostgreSQL server that the
session starts itself (`harnessrl.store.pg_local`: initdb into a temporary directory, pg_ctl on a free
loopback port, as an unprivileged user when the tests run as root).

`store_backend` is parametrized over "sqlite" and "postgres"; a test that takes it (or `store_factory`,
or `store`) runs once per backend. Without PostgreSQL server binaries the postgres case is skipped with
the reason (`make install` installs Debian's `postgresql` where it is missing, so CI runs it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harnessrl.store import Store, open_store
from harnessrl.store.pg_local import LocalPostgres, PostgresUnavailable

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[LocalPostgres]:
    """One PostgreSQL server for the whole session (skips when none can be started)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg 3 is not installed (pip install 'harnessrl[postgres]')")
    try:
        server = LocalPostgres().start()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server for the postgres store tests: {e}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: LocalPostgres) -> Iterator[str]:
    """A fresh, empty database for this test; dropped after it."""
    url = pg_server.create_database()
    try:
        yield url
    finally:
        pg_server.drop_database(url)


@dataclass
class StoreFactory:
    """Opens stores on one backing (a SQLite file or a PostgreSQL database): each `open()` is a new
    store instance, as a restarted gateway or another replica would have; all are closed at teardown."""

    backend: str
    spec: str | Path
    opened: list[Store] = field(default_factory=list)

    def open(self) -> Store:
        store = open_store(self.spec)
        self.opened.append(store)
        return store

    def close_all(self) -> None:
        for s in self.opened:
            s.close()


@pytest.fixture(params=BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    """The store backend under test."""
    return str(request.param)


@pytest.fixture
def store_factory(
    store_backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[StoreFactory]:
    """A `StoreFactory` on a fresh SQLite file or a fresh PostgreSQL database."""
    spec: str | Path = (
        request.getfixturevalue("pg_url") if store_backend == "postgres" else tmp_path / "store.sqlite"
    )
    factory = StoreFactory(store_backend, spec)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture
def store(store_factory: StoreFactory) -> Store:
    """A store on a fresh backing, of each backend."""
    return store_factory.open()


OpenStore = Callable[[], Store]
