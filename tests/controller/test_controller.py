"""The controller and its local runner with real subprocesses: exit codes, crashes, timeouts that
kill the whole process group, infrastructure retries, grader crashes, the harness contract."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.controller import AttemptResult, Controller, HarnessSpec, LocalRunner, RolloutRequest
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import AttemptStatus, RewardIn, RolloutState, Task
from tests.support.gateway import GatewayHandle

HARNESS = r"""
import json, os, subprocess, sys, time
mode = json.load(open(os.environ["HARNESSRL_TASK"]))["mode"]
out = os.environ["HARNESSRL_OUTPUT"]
json.dump({k: os.environ.get(k) for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL",
           "HARNESSRL_ROLLOUT_ID", "SECRET_FROM_PARENT", "HOME")}, open(os.path.join(out, "env.json"), "w"))
if mode == "ok":
    open(os.path.join(out, "answer.txt"), "w").write("42")
elif mode == "crash":
    raise SystemExit(3)
elif mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.path.join(out, "child.pid"), "w").write(str(child.pid))
    time.sleep(600)
"""


def grader(task: Task, result: AttemptResult) -> RewardIn:
    if task.input["mode"] == "grader-crash":
        raise RuntimeError("grader bug")
    answer = result.output_dir / "answer.txt"
    return RewardIn(value=float(answer.exists() and answer.read_text() == "42"))


@pytest.fixture
def harness_file(tmp_path: Path) -> Path:
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    return path


async def _run(gw: GatewayHandle, tmp_path: Path, harness: HarnessSpec, modes: list[str], runner=None):  # type: ignore[no-untyped-def]
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, harness, grader, tmp_path / "run", concurrency=4, max_attempts=2,
                     grader_timeout_s=10, runner=runner)  # fmt: skip
    reqs = [
        RolloutRequest(Task(task_id=f"t{i}", input={"mode": m}), client_id=f"c{i}")
        for i, m in enumerate(modes)
    ]
    try:
        return await ctl.run(reqs)
    finally:
        await client.aclose()


async def test_results_crashes_and_grader_failures(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                                   harness_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("SECRET_FROM_PARENT", "do-not-leak")
    gw = make_gateway()
    spec = HarnessSpec(command=[sys.executable, str(harness_file)], timeout_s=30)
    ok, crash, gcrash = await _run(gw, tmp_path, spec, ["ok", "crash", "grader-crash"])
    assert (ok.state, ok.reward, ok.timed_out) == (RolloutState.SUCCEEDED, 1.0, False)
    assert (crash.state, crash.reward) == (RolloutState.SUCCEEDED, 0.0)  # a harness crash is a graded result
    assert gw.store.get_reward(crash.rollout_id).details["exit_code"] == 3  # type: ignore[union-attr]
    assert (
        gcrash.state == RolloutState.FAILED and gcrash.reward is None and "grader bug" in (gcrash.error or "")
    )
    env = json.loads((tmp_path / "run/rollouts" / ok.rollout_id / "attempt-0/output/env.json").read_text())
    assert env["OPENAI_BASE_URL"] == f"{gw.url}/v1" and env["ANTHROPIC_BASE_URL"] == gw.url
    assert env["HARNESSRL_ROLLOUT_ID"] == ok.rollout_id and env["OPENAI_API_KEY"].startswith("hrl-")
    assert env["SECRET_FROM_PARENT"] is None  # the environment is scrubbed to the contract
    assert [a.status for a in gw.store.attempts(crash.rollout_id)] == [AttemptStatus.EXITED]


async def test_timeout_kills_the_whole_process_group(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                                     harness_file: Path) -> None:  # fmt: skip
    gw = make_gateway()
    spec = HarnessSpec(command=[sys.executable, str(harness_file)], timeout_s=2)
    (hang,) = await _run(gw, tmp_path, spec, ["hang"])
    assert hang.state == RolloutState.SUCCEEDED and hang.reward == 0.0 and hang.timed_out  # reported as such
    assert [a.status for a in gw.store.attempts(hang.rollout_id)] == [AttemptStatus.TIMEOUT]
    child = int((tmp_path / "run/rollouts" / hang.rollout_id / "attempt-0/output/child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the harness's child process survived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


class FlakyRunner(LocalRunner):
    """Fails to start the first attempt, as a lost node would."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, spec, harness):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            return AttemptResult(None, False, spec.workdir, "", "", infra_error="sandbox setup failed")
        return await super().run(spec, harness)


async def test_infrastructure_failure_is_retried_as_a_new_attempt(make_gateway: Callable[..., GatewayHandle],
                                                                  tmp_path: Path, harness_file: Path) -> None:  # fmt: skip
    gw = make_gateway()
    spec = HarnessSpec(command=[sys.executable, str(harness_file)], timeout_s=30)
    (ok,) = await _run(gw, tmp_path, spec, ["ok"], runner=FlakyRunner())
    assert (ok.state, ok.reward) == (RolloutState.SUCCEEDED, 1.0)
    assert [a.status for a in gw.store.attempts(ok.rollout_id)] == [
        AttemptStatus.INFRA_ERROR,
        AttemptStatus.EXITED,
    ]
    missing = HarnessSpec(command=["/nonexistent/harness"], timeout_s=5)
    (lost,) = await _run(gw, tmp_path, missing, ["ok"])
    assert lost.state == RolloutState.SUCCEEDED  # idempotent: client id c0 already finished
    gw2_ro = await _run(gw, tmp_path, missing, ["ok", "ok"])
    assert gw2_ro[1].state == RolloutState.FAILED and "could not start" in (gw2_ro[1].error or "")
    assert len(gw.store.attempts(gw2_ro[1].rollout_id)) == 2
