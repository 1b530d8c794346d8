"""Restart safety: a controller killed with `kill -9` mid-run leaves no harness running, and a restarted
controller given the same requests finishes every rollout without running a finished attempt twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from harnessrl.schema import AttemptStatus, RolloutState
from tests.support.gateway import GatewayHandle

N = 6


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def _events(log_dir: Path) -> list[list[str]]:
    path = log_dir / "events.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _driver(gw: GatewayHandle, run_dir: Path, log_dir: Path) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.controller_driver", gw.url, gw.admin_key, str(run_dir), str(log_dir), str(N)],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip


def test_kill_and_restart_loses_and_duplicates_nothing(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    run_dir, log_dir = tmp_path / "run", tmp_path / "log"
    run_dir.mkdir()
    log_dir.mkdir()
    first = _driver(gw, run_dir, log_dir)
    # wait until every harness started and the fast ones ended (they are now being graded, slowly)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ev = _events(log_dir)
        if sum(e[0] == "start" for e in ev) == N and sum(e[0] == "end" for e in ev) == N // 2:
            break
        time.sleep(0.1)
    else:
        first.kill()
        raise AssertionError(f"harnesses did not start: {_events(log_dir)} {first.communicate()}")
    time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait()
    started = [e for e in _events(log_dir) if e[0] == "start"]
    # the harnesses die with their controller; their own children (tools) are left for the restart
    deadline = time.monotonic() + 10
    while any(_alive(int(e[2])) for e in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(int(e[2])) for e in started), "a harness outlived its controller"
    states = {ro.rollout_id: ro.state for ro in gw.store.list_rollouts(limit=100)[0]}
    assert len(states) == N and all(s == RolloutState.RUNNING for s in states.values())

    second = _driver(gw, run_dir, log_dir)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    rollouts = gw.store.list_rollouts(limit=100)[0]
    assert len(rollouts) == N  # nothing was created twice
    ends = Counter(e[1] for e in _events(log_dir) if e[0] == "end")
    for ro in rollouts:
        assert ro.state == RolloutState.SUCCEEDED, (ro, out, err)
        reward = gw.store.get_reward(ro.rollout_id)
        assert reward is not None and reward.value == 1.0
        attempts = gw.store.attempts(ro.rollout_id)
        exited = [a for a in attempts if a.status == AttemptStatus.EXITED]
        assert len(exited) == 1 and ends[ro.rollout_id] == 1  # each harness ran to its end once
        if len(attempts) == 2:  # killed mid-run: the abandoned attempt is an infrastructure failure
            assert attempts[0].status == AttemptStatus.INFRA_ERROR and "abandoned" in (
                attempts[0].error or ""
            )
    assert sum(len(gw.store.attempts(ro.rollout_id)) == 2 for ro in rollouts) == N // 2
    assert sum(len(gw.store.attempts(ro.rollout_id)) == 1 for ro in rollouts) == N // 2  # regraded only
    # the restart reaped the tool processes the dead harnesses had left behind
    for e in started:
        assert not _alive(int(e[3])), f"tool process {e[3]} of {e[1]} still running"
