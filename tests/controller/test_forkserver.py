"""The fork-server runner with real processes: it keeps LocalRunner's contract (the same argv, cwd,
sys.path[0], environment, output files and exit codes for `python SCRIPT`, `-m` and `-c`), the
timeout kills the whole process group, preloaded modules are already imported in the harness, other
commands fall back to a plain subprocess, and a broken or dead zygote is an error, not a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.controller import (
    AttemptSpec,
    ForkServerError,
    ForkServerRunner,
    HarnessSpec,
    LocalRunner,
    SandboxRunner,
)
from harnessrl.controller.factory import make_runner
from harnessrl.examples import get_example
from harnessrl.schema import AttemptStatus, RolloutState
from tests.controller.test_controller import HARNESS, _alive, _run
from tests.support.gateway import GatewayHandle

PRELOAD = "xml.dom.minidom"  # imported by nothing at start-up: its presence shows the preload
PROBE = f"""
import json, os, random, sys
mod = {PRELOAD!r} in sys.modules
json.dump({{"preloaded": mod, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
           "env": dict(os.environ), "random": random.random(), "pid": os.getpid(), "pgid": os.getpgid(0),
           "main": __name__}}, open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "probe.json"), "w"))
print("to stdout")
print("to stderr", file=sys.stderr)
what = sys.argv[-1]
if what == "raise":
    raise ValueError("harness bug")
if what == "kill":
    os.kill(os.getpid(), 9)
if what.isdigit():
    sys.exit(int(what))
"""


@pytest.fixture
async def fork_runner():  # type: ignore[no-untyped-def]
    runner = ForkServerRunner([PRELOAD])
    yield runner
    runner.close()


def _attempt(tmp_path: Path, name: str) -> AttemptSpec:
    return AttemptSpec(name, 0, "hrl-key", "http://127.0.0.1:9", {"n": name}, tmp_path / name)


def _probe(result) -> dict:  # type: ignore[no-untyped-def]
    return json.loads((result.output_dir / "probe.json").read_text())


def _forms(tmp_path: Path, arg: str) -> dict[str, list[str]]:
    script = tmp_path / "probe_script.py"
    script.write_text(PROBE)
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "probe_mod.py").write_text(PROBE)
    return {
        "path": [sys.executable, str(script), "a b", arg],
        "module": [sys.executable, "-m", "probe_mod", arg],
        "code": [sys.executable, "-c", PROBE, arg],
    }


@pytest.mark.parametrize("form", ["path", "module", "code"])
async def test_a_forked_harness_sees_what_a_fresh_interpreter_sees(
    fork_runner: ForkServerRunner, tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_FROM_PARENT", "do-not-leak")
    command = _forms(tmp_path, "0")[form]
    env = {"PYTHONPATH": str(tmp_path / "pkg")} if form == "module" else {}
    spec = HarnessSpec(command, timeout_s=30, env=env)
    forked = await fork_runner.run(_attempt(tmp_path, "forked"), spec)
    fresh = await LocalRunner().run(_attempt(tmp_path, "fresh"), spec)
    a, b = _probe(forked), _probe(fresh)
    assert (a["preloaded"], b["preloaded"]) == (True, False)
    assert a["cwd"] == str(tmp_path / "forked" / "home") and b["cwd"] == str(tmp_path / "fresh" / "home")
    assert a["env"].pop("HARNESSRL_OUTPUT") != b["env"].pop("HARNESSRL_OUTPUT")
    for d in (a, b):
        for k in ("HOME", "HARNESSRL_TASK", "HARNESSRL_ROLLOUT_ID"):
            d["env"].pop(k)
    assert a["env"] == b["env"] and "SECRET_FROM_PARENT" not in a["env"]
    if form == "module":  # python -m puts the cwd first on sys.path; here the cwds differ
        assert (a["path0"], b["path0"]) == (a["cwd"], b["cwd"])
    else:
        assert a["path0"] == b["path0"]
    assert a["argv"] == b["argv"] and a["main"] == b["main"] == "__main__"
    assert a["pid"] == a["pgid"] and a["pid"] != os.getpid()  # a process group of its own
    for r in (forked, fresh):
        assert (r.exit_code, r.timed_out, r.infra_error) == (0, False, None)
        assert (r.stdout_tail, r.stderr_tail) == ("to stdout\n", "to stderr\n")


async def test_a_relative_pythonpath_means_the_controllers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `PYTHONPATH=pkg harnessrl ...` typed in a checkout: the harness runs in its attempt's folder, where
    # "pkg" named nothing (the sandboxed fork server failed to import its preload from `PYTHONPATH=src`)
    command = _forms(tmp_path, "0")["module"]
    monkeypatch.chdir(tmp_path)
    before = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["pkg", *([before] if before else [])]))
    runner = ForkServerRunner([PRELOAD])  # the zygote's environment is read when it starts
    try:
        spec = HarnessSpec(command, timeout_s=30)
        results = [
            await runner.run(_attempt(tmp_path, "forked"), spec),
            await LocalRunner().run(_attempt(tmp_path, "fresh"), spec),
        ]
    finally:
        runner.close()
    for r in results:
        assert (r.exit_code, r.infra_error) == (0, None), r.stderr_tail
        assert _probe(r)["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "pkg")


@pytest.mark.parametrize(("arg", "code"), [("7", 7), ("raise", 1), ("kill", -9)])
async def test_exit_codes_match_a_fresh_interpreter(
    fork_runner: ForkServerRunner, tmp_path: Path, arg: str, code: int
) -> None:
    spec = HarnessSpec(_forms(tmp_path, arg)["path"], timeout_s=30)
    forked = await fork_runner.run(_attempt(tmp_path, "forked"), spec)
    fresh = await LocalRunner().run(_attempt(tmp_path, "fresh"), spec)
    assert forked.exit_code == fresh.exit_code == code
    if arg == "raise":
        assert "ValueError: harness bug" in forked.stderr_tail and "Traceback" in forked.stderr_tail


async def test_concurrent_attempts_are_separate_processes_with_their_own_random_state(
    fork_runner: ForkServerRunner, tmp_path: Path
) -> None:
    spec = HarnessSpec(_forms(tmp_path, "0")["path"], timeout_s=30)
    results = await asyncio.gather(*[fork_runner.run(_attempt(tmp_path, f"a{i}"), spec) for i in range(8)])
    probes = [_probe(r) for r in results]
    assert all(r.exit_code == 0 for r in results)
    assert len({p["pid"] for p in probes}) == 8
    assert len({p["random"] for p in probes}) == 8  # `random` is reseeded in each forked child
    assert fork_runner.starts == 1


async def test_other_commands_run_as_plain_subprocesses(
    fork_runner: ForkServerRunner, tmp_path: Path
) -> None:
    script = _forms(tmp_path, "0")["path"][1]
    with_option = await fork_runner.run(
        _attempt(tmp_path, "u"), HarnessSpec([sys.executable, "-u", script, "0"])
    )
    assert with_option.exit_code == 0 and _probe(with_option)["preloaded"] is False
    shell = await fork_runner.run(_attempt(tmp_path, "sh"), HarnessSpec(["/bin/sh", "-c", "echo hi; exit 4"]))
    assert (shell.exit_code, shell.stdout_tail) == (4, "hi\n")
    hashseed = HarnessSpec(
        [sys.executable, script, "0"], env={"PYTHONHASHSEED": "0"}
    )  # read at start-up only
    fresh = await fork_runner.run(_attempt(tmp_path, "seed"), hashseed)
    assert fresh.exit_code == 0 and _probe(fresh)["preloaded"] is False
    assert fork_runner.starts == 0  # none of them needed the zygote


async def test_timeout_kills_the_forked_harness_and_its_children(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, fork_runner: ForkServerRunner
) -> None:
    harness_file = tmp_path / "harness.py"
    harness_file.write_text(HARNESS)
    gw = make_gateway()
    spec = HarnessSpec(command=[sys.executable, str(harness_file)], timeout_s=2)
    ok, crash, hang = await _run(gw, tmp_path, spec, ["ok", "crash", "hang"], runner=fork_runner)
    assert (ok.state, ok.reward) == (RolloutState.SUCCEEDED, 1.0)
    assert gw.store.get_reward(crash.rollout_id).details["exit_code"] == 3  # type: ignore[union-attr]
    assert [a.status for a in gw.store.attempts(hang.rollout_id)] == [AttemptStatus.TIMEOUT]
    child = int((tmp_path / "run/rollouts" / hang.rollout_id / "attempt-0/output/child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the forked harness's child survived the timeout"


async def test_a_preload_that_fails_is_a_clear_error(tmp_path: Path) -> None:
    runner = ForkServerRunner(["no_such_module_for_harnessrl"])
    try:
        with pytest.raises(ForkServerError, match=r"no_such_module_for_harnessrl.*ModuleNotFoundError"):
            await runner.start()
        result = await runner.run(_attempt(tmp_path, "a"), HarnessSpec(_forms(tmp_path, "0")["path"]))
        assert result.exit_code is None and "no_such_module_for_harnessrl" in (result.infra_error or "")
    finally:
        runner.close()


async def test_a_dead_zygote_fails_its_attempts_and_is_started_again(
    fork_runner: ForkServerRunner, tmp_path: Path
) -> None:
    hang = HarnessSpec([sys.executable, "-c", "import os, time; open('pid', 'w').write(str(os.getpid())); "
                        "time.sleep(600)"], timeout_s=60)  # fmt: skip
    task = asyncio.create_task(fork_runner.run(_attempt(tmp_path, "hang"), hang))
    pid_file = tmp_path / "hang" / "home" / "pid"  # written in the working directory, home/
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    harness_pid = int(pid_file.read_text())
    assert fork_runner._proc is not None
    os.kill(fork_runner._proc.pid, signal.SIGKILL)
    result = await asyncio.wait_for(task, 20)
    assert result.infra_error == "fork server exited before the harness did"
    deadline = time.monotonic() + 5
    while _alive(harness_pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(harness_pid), "a harness outlived its zygote"
    again = await fork_runner.run(_attempt(tmp_path, "again"), HarnessSpec(_forms(tmp_path, "5")["path"]))
    assert again.exit_code == 5 and fork_runner.starts == 2


async def test_the_zygote_answers_a_bad_request_and_keeps_serving(
    fork_runner: ForkServerRunner, tmp_path: Path
) -> None:
    await fork_runner.start()
    assert fork_runner._socket is not None
    for bad, why in [(b"not json\n", "not JSON"), (b'{"kind": "exec"}\n', "kind must be"),
                     (b'{"kind": "path", "target": "x", "cwd": "/", "stdout": "o", "stderr": "e", "args": [1]}\n',
                      "args must be")]:  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(fork_runner._socket))
            s.sendall(bad)
            answer = json.loads(s.makefile().readline())
        assert why in answer["error"]
    ok = await fork_runner.run(_attempt(tmp_path, "ok"), HarnessSpec(_forms(tmp_path, "0")["path"]))
    assert ok.exit_code == 0 and fork_runner.starts == 1


async def test_close_stops_the_zygote_and_its_running_harnesses(tmp_path: Path) -> None:
    runner = ForkServerRunner()
    hang = HarnessSpec([sys.executable, "-c", "import os, time; open('pid', 'w').write(str(os.getpid())); "
                        "time.sleep(600)"], timeout_s=60)  # fmt: skip
    task = asyncio.create_task(runner.run(_attempt(tmp_path, "hang"), hang))
    pid_file = tmp_path / "hang" / "home" / "pid"  # written in the working directory, home/
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    socket_dir = runner._dir
    runner.close()
    result = await asyncio.wait_for(task, 20)
    assert result.infra_error is not None
    assert socket_dir is not None and not socket_dir.exists()
    deadline = time.monotonic() + 5
    harness_pid = int(pid_file.read_text())
    while _alive(harness_pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(harness_pid)


def test_config_builds_the_runner_only_for_local_runs() -> None:
    """The calc example (`fork_server: true` under `sandbox: auto`): the sandboxed fork server where
    bwrap works, the plain one with `sandbox=false`; without `fork_server`, the exec sandbox or plain."""
    from harnessrl.controller.runners.sandbox import bwrap_problem
    from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner

    path = get_example("calc").config_path
    plain = ["controller.sandbox=false"]
    runner = make_runner(load_config(path, [*plain, "controller.preload=[openai, json]"]).controller)
    assert isinstance(runner, ForkServerRunner) and runner.preload == ("openai", "json")
    off = [*plain, "controller.fork_server=false"]
    assert type(make_runner(load_config(path, off).controller)) is LocalRunner
    if bwrap_problem() is None:
        default = make_runner(load_config(path, []).controller)
        assert isinstance(default, SandboxedForkServerRunner) and default.preload == (
            "harnessrl.preload.openai",
        )
        exec_only = ["controller.sandbox=true", "controller.fork_server=false"]
        assert type(make_runner(load_config(path, exec_only).controller)) is SandboxRunner


async def test_a_harness_whose_runner_went_away_is_killed(
    fork_runner: ForkServerRunner, tmp_path: Path
) -> None:
    await fork_runner.start()
    assert fork_runner._socket is not None
    workdir = tmp_path / "orphan"
    workdir.mkdir()
    request = {"kind": "code", "target": "import time; time.sleep(600)", "args": [], "cwd": str(workdir),
               "env": {}, "stdout": str(workdir / "out"), "stderr": str(workdir / "err")}  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(fork_runner._socket))
        s.sendall(json.dumps(request).encode() + b"\n")
        pid = json.loads(s.makefile().readline())["pid"]
        assert _alive(pid)
    deadline = time.monotonic() + 5  # the connection is closed without an exit report: nobody waits
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(pid), "a forked harness outlived the connection of the runner that started it"
