"""A throwaway local PostgreSQL server, for the test suite and the benchmarks (not for production).

The server binaries are the machine's: `$HARNESSRL_PG_BIN`, else `pg_config --bindir`, else Debian's
`/usr/lib/postgresql/<version>/bin` (the `postgresql` package; `make install` installs it where it is
missing), else `initdb` on the PATH. The cluster lives in a temporary directory, listens on a free
loopback port with trust authentication and no Unix socket, and is stopped (and deleted) on `stop`.
PostgreSQL refuses to run as root: as root the cluster is owned by, and the server runs as, an
unprivileged user (`nobody` unless `$HARNESSRL_PG_USER` names another).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries were found, or the server would not start."""


def find_pg_bin() -> Path | None:
    """The directory holding `initdb`, `pg_ctl` and `postgres`, or None. `$HARNESSRL_PG_BIN`, when set, is
    the only place looked at."""
    candidates: list[str] = []
    if os.environ.get("HARNESSRL_PG_BIN"):
        d = Path(os.environ["HARNESSRL_PG_BIN"])
        return d if all((d / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")) else None
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            candidates.append(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True,
                                             timeout=10, check=True).stdout.strip())  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            pass
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    candidates += debian
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).resolve().parent))
    for c in candidates:
        d = Path(c)
        if all((d / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """One PostgreSQL cluster in a temporary directory; `url(db)` names a database on it."""

    def __init__(
        self, bin_dir: Path | None = None, fsync: bool = False, superuser: str = "harnessrl"
    ) -> None:
        found = bin_dir or find_pg_bin()
        if found is None:
            raise PostgresUnavailable(
                "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found: install Debian's "
                "'postgresql' package (make install does) or set HARNESSRL_PG_BIN to their directory"
            )
        self.bin = found
        self.fsync = fsync
        self.superuser = superuser
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="harnessrl-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = os.environ.get("HARNESSRL_PG_USER", "nobody")
            try:
                pw = pwd.getpwnam(self._user)
            except KeyError as e:
                raise PostgresUnavailable(f"user {self._user!r} (to run PostgreSQL as) does not exist") from e
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.started = False

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self._user is not None:
            pw = pwd.getpwnam(self._user)
            kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env = {**os.environ, "LC_ALL": "C", "LANG": "C", "HOME": str(self.root)}
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=self.root, check=False, **kwargs)  # type: ignore[call-overload]  # fmt: skip

    def start(self) -> LocalPostgres:
        """initdb and start the server; waits until it accepts connections."""
        r = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.superuser, "--auth=trust",
                      "-E", "UTF8", "--no-sync", "--locale=C")  # fmt: skip
        if r.returncode != 0:
            raise PostgresUnavailable(f"initdb failed: {r.stderr.strip()[-2000:]}")
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200 -c shared_buffers=64MB")  # fmt: skip
        r = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts,
                      "-w", "-t", "60", "start")  # fmt: skip
        if r.returncode != 0:
            log_tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise PostgresUnavailable(f"pg_ctl start failed: {r.stderr.strip()[-1000:]} {log_tail}")
        self.started = True
        return self

    def url(self, database: str = "postgres") -> str:
        """The connection URL of `database` on this server."""
        return f"postgresql://{self.superuser}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop the database of `url` (its connections are cut)."""
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its directory."""
        if self.started:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m harnessrl.store.pg_local [--database NAME]`: start a throwaway server, print the URL of
    a fresh database on it, serve until interrupted (Ctrl-C, SIGTERM), then stop it and delete it all."""
    import argparse
    import signal
    import sys

    p = argparse.ArgumentParser(prog="python -m harnessrl.store.pg_local", description=main.__doc__)
    p.add_argument("--database", default="harnessrl", help="name of the database to create")
    args = p.parse_args(argv)
    try:
        server = LocalPostgres().start()
    except PostgresUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(server.create_database(args.database), flush=True)
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
