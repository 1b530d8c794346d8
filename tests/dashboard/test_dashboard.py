"""`harnessrl dashboard`: the JSON API over real HTTP on loopback, against a synthetic run (pages and
filters checked against the store read directly) and the real-tokenizer run of test_inspect (one
rollout's calls and rows); read-only; the admin key; live updates; the command's refusals."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.dashboard import synthetic_run

from harnessrl.dashboard import RunData, create_dashboard
from harnessrl.dashboard.cli import main as dashboard_main
from harnessrl.inspection import rollout_report
from harnessrl.schema import RewardIn, RolloutCreate
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer
from tests.support.run_fixtures import Fixture


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 steps x 5 groups x 4 rollouts, held-out evaluations at steps 0 and 10."""
    run = tmp_path_factory.mktemp("synth") / "run"
    synthetic_run(run, steps=12, groups=5, group_size=4, calls=3, prompt_len=40, seed=1)
    return run


def _serve(run_dir: Path, key: str | None = None) -> ThreadServer:
    return ThreadServer(create_dashboard(RunData(run_dir / "store.sqlite", run_dir), key))


@pytest.fixture(scope="module")
def api(synth: Path) -> Iterator[httpx.Client]:
    with _serve(synth) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _truth(run_dir: Path) -> list[dict[str, Any]]:
    """Every rollout with its step, state and reward, read from the store without the dashboard."""
    store = SQLiteStore(run_dir / "store.sqlite")
    try:
        rows = store.query(
            "SELECT r.rollout_id, r.metadata, r.state, r.group_id, w.value FROM rollouts r"
            " LEFT JOIN rewards w USING (rollout_id) ORDER BY r.seq"
        )
    finally:
        store.close()
    return [{"rollout_id": rid, "meta": json.loads(m), "state": st, "group_id": g, "reward": v}
            for rid, m, st, g, v in rows]  # fmt: skip


def _all_pages(api: httpx.Client, query: str, limit: int = 7) -> list[dict[str, Any]]:
    items, offset = [], 0
    while True:
        page = api.get(f"/api/rollouts?{query}&offset={offset}&limit={limit}").json()
        items += page["items"]
        offset += limit
        if offset >= page["total"]:
            assert len(items) == page["total"]
            return items


def test_pages_and_filters_match_the_store(api: httpx.Client, synth: Path) -> None:
    truth = _truth(synth)
    train = [t for t in truth if "step" in t["meta"]]
    listed = _all_pages(api, "phase=train")
    assert [r["rollout_id"] for r in listed] == [t["rollout_id"] for t in train]  # step order, every one once
    assert [r["step"] for r in listed] == [t["meta"]["step"] + 1 for t in train]
    step3 = _all_pages(api, "step=3")
    assert [r["rollout_id"] for r in step3] == [t["rollout_id"] for t in train if t["meta"]["step"] == 2]
    failed = _all_pages(api, "state=failed")
    assert {r["rollout_id"] for r in failed} == {t["rollout_id"] for t in train if t["state"] == "failed"}
    assert failed and all(r["reward"] is None for r in failed)
    high = _all_pages(api, "reward_min=0.75&reward_max=1")
    assert {r["rollout_id"] for r in high} == {t["rollout_id"] for t in train if (t["reward"] or 0) >= 0.75}
    groups: dict[str, list[float]] = {}
    for t in train:
        if t["state"] == "succeeded" and t["reward"] is not None:
            groups.setdefault(t["group_id"], []).append(t["reward"])
    flat = {g for g, rs in groups.items() if len(rs) >= 2 and max(rs) == min(rs)}
    zv = _all_pages(api, "zero_variance=1")
    assert flat and {r["group_id"] for r in zv} == flat and all(r["zero_variance_group"] for r in zv)
    assert len(zv) == sum(t["group_id"] in flat for t in train)
    evals = _all_pages(api, "phase=eval")
    assert len(evals) == 10 and {r["eval_label"] for r in evals} == {"eval-step0-t0", "eval-step10-t0"}
    one = api.get("/api/rollouts?step=1&limit=50").json()["items"][0]
    assert (
        one["calls"] == 3 and one["rows"] == 2 and one["breaks"] == {"history_edited": 1}
    )  # ro0000000 breaks


def test_steps_groups_and_overview(api: httpx.Client, synth: Path) -> None:
    steps = api.get("/api/steps").json()
    assert steps["steps"] == list(range(1, 13)) and len(steps["metrics"]) == 12
    assert steps["recorded"]["3"] == {"rollouts": 20, "failed": sum(
        t["state"] == "failed" for t in _truth(synth) if t["meta"].get("step") == 2)}  # fmt: skip
    held = {h["label"]: h for h in steps["heldout"]}
    assert set(held) == {"eval-step0-t0", "eval-step10-t0"} and held["eval-step10-t0"]["step"] == 10
    groups = api.get("/api/groups?step=3").json()["groups"]
    assert len(groups) == 5 and all(g["rollouts"] == 4 for g in groups)
    for g in groups:
        graded = [r for r in g["rewards"] if r is not None]
        assert g["reward_mean"] == pytest.approx(sum(graded) / len(graded))
    run = api.get("/api/run").json()
    assert (
        run["rollouts"] == len(_truth(synth)) and run["name"] == "synthetic" and run["steps_recorded"] == 12
    )


def test_bad_parameters_are_400_and_unknown_rollouts_404(api: httpx.Client) -> None:
    for query, message in [
        ("step=x", "step must be an integer"), ("offset=-1", "offset must be >= 0"), ("limit=0", "limit must be >= 1"),
        ("phase=dev", "phase must be one of"), ("state=done", "state must be one of"),
        ("reward_min=nan", "reward_min must be finite"), ("zero_variance=maybe", "zero_variance must be"),
    ]:  # fmt: skip
        r = api.get(f"/api/rollouts?{query}")
        assert r.status_code == 400 and message in r.json()["error"], query
    r = api.get("/api/rollouts/nosuchrollout")
    assert r.status_code == 404 and "no rollout matches 'nosuchrollout'" in r.json()["error"]
    assert api.post("/api/rollouts").status_code == 405 and api.delete("/api/run").status_code == 405


def test_one_rollout_is_the_inspect_report_with_conversations(fixture_run: Fixture) -> None:
    run = fixture_run.run_dir
    with _serve(run) as srv, httpx.Client(base_url=srv.url) as c:
        got = c.get("/api/rollouts/roaaaa1111").json()
        prefix = c.get("/api/rollouts/robbbb").json()  # a unique prefix works as in inspect
    want = rollout_report(run, "roaaaa1111")
    assert got["rows"] == want["rows"] and got["rollout"] == want["rollout"]
    assert [c["break_cause"] for c in got["calls"]] == [None, None, "history_edited"]
    assert got["calls"][0]["tool_calls"] == [{"name": "calc", "arguments": {"expression": "2+3"}}]
    assert got["calls"][1]["messages"][-1] == {"role": "tool", "content": "5", "tool_calls": []}
    assert got["calls"][1]["messages"][1]["tool_calls"][0]["name"] == "calc" and got["calls"][0]["tools"] == [
        "calc"
    ]
    assert prefix["rollout"]["rollout_id"] == "robbbb3333"


def test_the_dashboard_never_writes_to_the_run(fixture_run: Fixture) -> None:
    run = fixture_run.run_dir
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir() if p.is_file()}
    with _serve(run) as srv, httpx.Client(base_url=srv.url) as c:
        for path in (
            "/api/run",
            "/api/steps",
            "/api/rollouts?phase=all",
            "/api/groups",
            "/api/rollouts/roaaaa1111",
        ):
            assert c.get(path).status_code == 200, path
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir() if p.is_file()}
    assert {k: after[k] for k in before} == before  # not a byte of the store or the run's files changed
    # a reader of a WAL-mode database opens SQLite's shared-memory index and an (empty) WAL beside it
    assert set(after) - set(before) <= {"store.sqlite-shm", "store.sqlite-wal"}
    assert not (run / "store.sqlite-wal").exists() or (run / "store.sqlite-wal").stat().st_size == 0


def test_admin_key(fixture_run: Fixture) -> None:
    with (
        _serve(fixture_run.run_dir, key="s3cret") as srv,
        httpx.Client(base_url=srv.url, follow_redirects=True) as c,
    ):
        r = c.get("/api/run")
        assert r.status_code == 401 and "admin key" in r.json()["error"]
        assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/run", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        login = c.get("/?key=s3cret")  # followed: the cookie is set, the key leaves the URL
        assert login.status_code == 200 and login.history[0].status_code == 303
        assert (
            login.history[0].headers["location"] == "/"
            and "HttpOnly" in login.history[0].headers["set-cookie"]
        )
        assert c.get("/api/rollouts").status_code == 200  # by the cookie
    with _serve(fixture_run.run_dir, key="s3cret") as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get(f"{srv.url}//evil.example/x?key=s3cret&a=1%262")
        assert r.status_code == 303 and r.headers["location"] == "/evil.example/x?a=1%262"  # stays here


def test_live_stream_reports_new_records(fixture_run: Fixture) -> None:
    run = fixture_run.run_dir
    with _serve(run) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
        with c.stream("GET", "/api/live") as stream:
            lines = stream.iter_lines()
            first = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
            store = SQLiteStore(run / "store.sqlite")
            try:
                store.create_rollout(RolloutCreate(client_id="new-1", task_id="t"), "ronew00001")
                store.set_reward("ronew00001", RewardIn(value=1.0))
            finally:
                store.close()
            second = json.loads(next(x for x in lines if x.startswith("data: "))[6:])
        assert second["events"] > first["events"] and second["rewards"] == first["rewards"] + 1
        listed = c.get("/api/rollouts?phase=other").json()["items"]
    assert [r["rollout_id"] for r in listed] == ["ronew00001"]


def test_command_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], fixture_run: Fixture) -> None:
    cases = [
        (["--run", str(fixture_run.run_dir), "--host", "0.0.0.0"], "pass --admin-key KEY"),
        (["--run", str(tmp_path / "nope")], "no run directory at"),
        (["--store", str(tmp_path / "nope.sqlite")], "no store at"),
        (["--run", str(fixture_run.run_dir), "--store", "x"], "not allowed with argument"),
    ]
    (tmp_path / "junk.sqlite").write_text("junk " * 200)
    cases.append((["--store", str(tmp_path / "junk.sqlite")], "is not a readable harnessrl store"))
    for argv, message in cases:
        assert dashboard_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
