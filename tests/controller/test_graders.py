"""Graders as commands, and the Controller's policy for a grader that crashes: run it again up to
`grader_retries` times, then fail the rollout and say why."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.controller import AttemptResult, Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.grader import CommandGrader, GraderError, grade, parse_reward
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RewardIn, RolloutState, Task
from tests.support.gateway import GatewayHandle

GRADER = r"""
import json, os, sys, time
task = json.load(open(os.environ["HARNESSRL_GRADE_TASK"]))
mode = task["input"]["mode"]
answer = open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "answer.txt")).read()
print("noise before the reward line")
if mode == "number":
    print(float(answer == task["reference"]["answer"]))
elif mode == "json":
    print(json.dumps({"value": 0.5, "details": {"exit": os.environ["HARNESSRL_EXIT_CODE"]}}))
elif mode == "crash":
    sys.exit("grader broke")
elif mode == "garbage":
    print("reward: high")
elif mode == "slow":
    time.sleep(30)
"""


def _result(tmp_path: Path, answer: str) -> AttemptResult:
    out = tmp_path / "output"
    out.mkdir(exist_ok=True)
    (out / "answer.txt").write_text(answer)
    return AttemptResult(exit_code=0, timed_out=False, output_dir=out, stdout_tail="", stderr_tail="")


@pytest.fixture
def command(tmp_path: Path) -> list[str]:
    path = tmp_path / "grader.py"
    path.write_text(GRADER)
    return [sys.executable, str(path)]


async def test_command_grader_reads_the_last_line(command: list[str], tmp_path: Path) -> None:
    g = CommandGrader(command, timeout_s=10)
    task = Task(task_id="t", input={"mode": "number"}, reference={"answer": "42"})
    assert (await grade(g, task, _result(tmp_path, "42"))).value == 1.0
    assert (await grade(g, task, _result(tmp_path, "41"))).value == 0.0
    j = await grade(g, Task(task_id="t", input={"mode": "json"}), _result(tmp_path, "x"))
    assert j.value == 0.5 and j.details["exit"] == "0"


@pytest.mark.parametrize(("mode", "message"), [("crash", "exited 1: grader broke"),
                                               ("garbage", "not a reward"), ("slow", "ran past")])  # fmt: skip
async def test_command_grader_failures_are_grader_errors(
    command: list[str], tmp_path: Path, mode: str, message: str
) -> None:
    with pytest.raises(GraderError, match=message):
        await grade(
            CommandGrader(command, timeout_s=2),
            Task(task_id="t", input={"mode": mode}),
            _result(tmp_path, "1"),
        )


def test_parse_reward() -> None:
    assert parse_reward("1") == RewardIn(value=1.0)
    assert parse_reward('{"value": 0.25, "details": {"a": 1}}').details == {"a": 1}
    for bad in ("true", '"1"', "[1]", '{"details": {}}'):
        with pytest.raises((RuntimeError, ValueError)):
            parse_reward(bad)


async def test_a_crashing_grader_is_retried_then_fails_the_rollout(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    calls: dict[str, int] = {}

    def flaky(task: Task, result: AttemptResult) -> float:
        calls[task.task_id] = calls.get(task.task_id, 0) + 1
        if calls[task.task_id] <= int(task.input["crashes"]):
            raise RuntimeError(f"crash {calls[task.task_id]}")
        return 1.0

    client = ControlClient(gw.url, gw.admin_key)
    harness = HarnessSpec([sys.executable, "-c", "pass"], timeout_s=30)
    ctl = Controller(client, gw.url, harness, flaky, tmp_path / "run", grader_retries=1)
    try:
        once, twice = await ctl.run([RolloutRequest(Task(task_id="once", input={"crashes": 1}), "c-once"),
                                     RolloutRequest(Task(task_id="twice", input={"crashes": 2}), "c-twice")])  # fmt: skip
    finally:
        await client.aclose()
    assert (once.state, once.reward, calls["once"]) == (RolloutState.SUCCEEDED, 1.0, 2)
    assert twice.state == RolloutState.FAILED and twice.reward is None and calls["twice"] == 2
    assert "grader crashed" in (twice.error or "") and "crash 2" in (twice.error or "")
    assert len(gw.store.attempts(twice.rollout_id)) == 1  # the harness is not run again for a grader crash


SELF_REWARD = r"""
import json, os, urllib.error, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/harnessrl/reward", method="PUT",
                             data=json.dumps({"value": 0.7}).encode(),
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
try:
    status = urllib.request.urlopen(req).status
except urllib.error.HTTPError as e:
    status = e.code
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "status.txt"), "w").write(str(status))
"""


async def test_a_harness_writes_its_reward_only_if_its_task_allows(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    graded: list[str] = []

    def grader(task: Task, result: AttemptResult) -> float:
        graded.append(task.task_id)
        return 1.0

    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec([sys.executable, "-c", SELF_REWARD], timeout_s=30), grader,
                     tmp_path / "run")  # fmt: skip
    try:
        allowed, denied = await ctl.run([
            RolloutRequest(Task(task_id="allowed", input={}, allow_self_reward=True), "c-allowed"),
            RolloutRequest(Task(task_id="denied", input={}), "c-denied"),
        ])  # fmt: skip
    finally:
        await client.aclose()
    out = tmp_path / "run" / "rollouts"
    assert (out / allowed.rollout_id / "attempt-0/output/status.txt").read_text() == "200"
    assert (allowed.state, allowed.reward) == (RolloutState.SUCCEEDED, 0.7)
    assert (out / denied.rollout_id / "attempt-0/output/status.txt").read_text() == "403"
    assert (denied.reward, gw.store.get_reward(denied.rollout_id).value) == (1.0, 1.0)  # type: ignore[union-attr]
    assert graded == ["denied"]  # the harness's own reward stood; the grader ran only where it had to
