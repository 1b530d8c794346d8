"""`inspect` and `export` read a run whose store is a PostgreSQL database (`store: postgresql://…`) as
they read a SQLite run: the same recorded run copied into PostgreSQL gives the same report and rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from harnessrl.cli import main as harnessrl
from harnessrl.inspection import index_report, rollout_report
from harnessrl.inspection.runview import all_rollouts, open_run_store
from harnessrl.schema import AttemptFinish, RolloutCreate, RolloutState
from harnessrl.store import SQLiteStore, Store, open_store
from tests.support.run_fixtures import Fixture


def _copy(src: SQLiteStore, dst: Store) -> int:
    """Every rollout of `src` written into `dst` through the store API (attempts, calls, state, reward)."""
    rollouts = all_rollouts(src)
    for ro in rollouts:
        d = src.detail(ro.rollout_id)
        dst.create_rollout(RolloutCreate(client_id=ro.client_id, task_id=ro.task_id, group_id=ro.group_id,
                                         input=ro.input, metadata=ro.metadata), ro.rollout_id)  # fmt: skip
        for a in d.attempts:
            dst.start_attempt(ro.rollout_id)
            dst.add_calls([c for c in d.calls if c.attempt == a.attempt])
            dst.finish_attempt(ro.rollout_id, a.attempt, AttemptFinish(status=a.status, exit_code=a.exit_code,
                                                                       error=a.error))  # fmt: skip
            if a.attempt < len(d.attempts) - 1:
                dst.set_state(ro.rollout_id, RolloutState.QUEUED)
        dst.set_state(ro.rollout_id, ro.state)
        if d.reward is not None:
            dst.set_reward(ro.rollout_id, d.reward)  # type: ignore[arg-type]
    return len(rollouts)


def _rows(run_dir: Path, out: Path) -> list[dict[str, Any]]:
    assert harnessrl(["export", str(run_dir), "--format", "jsonl", "--out", str(out)]) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_inspect_and_export_read_a_postgres_run(fixture_run: Fixture, pg_url: str, tmp_path: Path) -> None:
    pg_run = tmp_path / "pg-run"
    pg_run.mkdir()
    cfg = json.loads((fixture_run.run_dir / "config.json").read_text())
    (pg_run / "config.json").write_text(json.dumps({**cfg, "store": pg_url}))
    sqlite = SQLiteStore(fixture_run.run_dir / "store.sqlite")
    pg = open_store(pg_url)
    try:
        assert _copy(sqlite, pg) == 5
    finally:
        sqlite.close()
        pg.close()
    assert not (pg_run / "store.sqlite").exists()
    store = open_run_store(pg_run)
    assert type(store).__name__ == "PostgresStore"
    store.close()

    def same(report: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in report.items() if k != "run_dir"}

    assert same(index_report(pg_run)) == same(index_report(fixture_run.run_dir))
    assert (
        rollout_report(pg_run, "roaaaa1111")["calls"]
        == rollout_report(fixture_run.run_dir, "roaaaa1111")["calls"]
    )
    assert _rows(pg_run, tmp_path / "pg.jsonl") == _rows(fixture_run.run_dir, tmp_path / "sqlite.jsonl")
    assert harnessrl(["inspect", str(pg_run)]) == 0
    shutil.rmtree(pg_run)


def test_the_dashboard_reads_a_postgres_run(fixture_run: Fixture, pg_url: str, tmp_path: Path) -> None:
    """The dashboard over a PostgreSQL run shows what it shows over the same run in SQLite."""
    import httpx

    from harnessrl.dashboard.app import create_dashboard
    from harnessrl.dashboard.data import RunData
    from tests.support.gateway import ThreadServer

    pg_run = tmp_path / "pg-run"
    pg_run.mkdir()
    cfg = json.loads((fixture_run.run_dir / "config.json").read_text())
    (pg_run / "config.json").write_text(json.dumps({**cfg, "store": pg_url}))
    sqlite, pg = SQLiteStore(fixture_run.run_dir / "store.sqlite"), open_store(pg_url)
    try:
        assert _copy(sqlite, pg) == 5
    finally:
        sqlite.close()
        pg.close()

    def pages(run_dir: Path) -> list[Any]:
        data = RunData(run_dir / "store.sqlite", run_dir)
        with ThreadServer(create_dashboard(data)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            got = [c.get(p).json() for p in ("/api/steps", "/api/groups", "/api/rollouts?phase=all")]
            got.append(c.get("/api/rollouts/roaaaa1111").json())
            assert c.get("/api/rollouts/ro-none").status_code == 404
            overview = c.get("/api/run").json()
        data.close()
        return [*got, {k: v for k, v in overview.items() if k not in ("run_dir", "store", "live")}]

    on_pg, on_sqlite = pages(pg_run), pages(fixture_run.run_dir)
    for detail in (on_pg[3], on_sqlite[3]):  # the copy's own: its folder and its attempts' clock
        del detail["run_dir"]
        for a in detail["rollout"]["attempt_details"]:
            del a["started_at"], a["ended_at"]
    assert on_pg == on_sqlite
    assert on_pg[2]["total"] == 5 and on_pg[3]["calls"]
