"""The dashboard's list of rollouts whose reward rose while their checks did not: the rule on hand-made
cases, and `/api/suspects` over real HTTP on a real SQLite store (bad parameters answer 400)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harnessrl.dashboard import RunData, create_dashboard
from harnessrl.dashboard.suspects import Graded, checks_of, unbacked_rises
from harnessrl.schema import AttemptFinish, AttemptStatus, RewardIn, RolloutCreate, RolloutState
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer


def test_the_rule_on_hand_made_cases() -> None:
    g = [
        Graded("a", "t1", "g", 1, 0.0, 2.0),  # honest, fails
        Graded("b", "t1", "g", 1, 1.0, 2.0),  # same checks, more reward: listed against a
        Graded("c", "t1", "g", 1, 1.0, 5.0),  # more checks: its reward is backed
        Graded("d", "t1", "h", 2, 0.5, 1.0, hacking={"guard": {}}),  # below a's checks, above its reward
        Graded("e", "t2", "k", 1, 1.0, None),  # no checks recorded
        Graded("f", "t2", "k", 1, 0.0, 0.0),  # alone with checks in its task
    ]
    listed, without = unbacked_rises(g)
    assert without == 1
    assert [(x["rollout_id"], x["baseline"]["rollout_id"], x["rise"]) for x in listed] == [
        ("b", "a", 1.0),
        ("d", "a", 0.5),
    ]
    assert listed[1]["hacking"] == {"guard": {}}
    assert checks_of({"passed": 3}, "passed") == 3.0
    assert (
        checks_of({"passed": True}, "passed") is None
        and checks_of({"passed": float("nan")}, "passed") is None
    )


def _rollout(store: SQLiteStore, rid: str, task: str, step: int, reward: RewardIn) -> None:
    store.create_rollout(RolloutCreate(client_id=rid, task_id=task, group_id=f"{task}-{step}",
                                       metadata={"step": step}), rid)  # fmt: skip
    store.start_attempt(rid)
    store.finish_attempt(rid, 0, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))
    store.set_reward(rid, reward)
    store.set_state(rid, RolloutState.SUCCEEDED)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[httpx.Client]:
    store = SQLiteStore(tmp_path / "store.sqlite")
    _rollout(store, "ro-honest", "t1", 0, RewardIn(value=0.0, details={"passed": 4, "tests": 5}))
    _rollout(store, "ro-hacked", "t1", 1, RewardIn(value=1.0, details={"passed": 4, "tests": 5,
             "hacking": {"guard": {"read_only_changed": {"modified": ["repo/tests/test_x.py"]}}}}))  # fmt: skip
    _rollout(store, "ro-fixed", "t1", 1, RewardIn(value=1.0, details={"passed": 5, "tests": 5}))
    _rollout(store, "ro-judge", "t2", 0, RewardIn(value=0.7, details={"score": 7}))
    store.close()
    app = create_dashboard(RunData(tmp_path / "store.sqlite", tmp_path))
    with ThreadServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def test_endpoint_lists_the_reward_that_rose_without_its_checks(api: httpx.Client) -> None:
    body = api.get("/api/suspects").json()
    assert (body["checks"], body["graded"], body["without_checks"], body["flagged_hacking"]) == (
        "passed",
        4,
        1,
        1,
    )
    (item,) = body["items"]
    assert item["rollout_id"] == "ro-hacked" and item["step"] == 2 and item["rise"] == 1.0
    assert item["baseline"] == {"rollout_id": "ro-honest", "reward": 0.0, "checks": 4.0, "step": 1}
    assert item["hacking"]["guard"]["read_only_changed"]["modified"] == ["repo/tests/test_x.py"]
    # a detail that does not measure the answer (the number of tests) lists the real fix too
    assert [i["rollout_id"] for i in api.get("/api/suspects?checks=tests").json()["items"]] == [
        "ro-fixed",
        "ro-hacked",
    ]
    assert api.get("/api/suspects?phase=eval").json()["graded"] == 0
    for bad, name in (("checks=a%20b", "checks"), ("phase=nope", "phase")):
        r = api.get(f"/api/suspects?{bad}")
        assert r.status_code == 400 and name in r.json()["error"]
    assert 'href="#/suspects"' in api.get("/").text and "suspectsView" in api.get("/static/app.js").text
