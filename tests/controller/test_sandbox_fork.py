"""The sandboxed fork server's own guarantees, beyond the escape, limit and kill tests it shares with
the exec sandbox (test_sandbox.py) and the hostile harness (test_isolation.py): two attempts forked
from one zygote at the same time cannot see each other (files, /tmp, loopback ports, processes,
keys); harnesses really are forked (the preloaded module is there before they import anything); a
command that cannot be forked runs in the exec sandbox; a bad request leaves the zygote serving."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.controller.runner import AttemptSpec, HarnessSpec
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner
from tests.controller.test_sandbox import _REFUSED
from tests.support.gateway import GatewayHandle

pytestmark = [
    pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or ""),
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandboxed fork server forks as root only"),
]

PRELOAD = "xml.dom.minidom"  # imported by nothing at start-up: present only when forked from the zygote

NEIGHBOURS = r"""
import glob, json, os, socket, sys, time
cfg = json.load(open(os.environ["HARNESSRL_TASK"]))
out = os.environ["HARNESSRL_OUTPUT"]
res = {"preloaded": "xml.dom.minidom" in sys.modules, "uid": os.getuid()}
if cfg["role"] == "first":
    open("/tmp/first-was-here", "w").write("x")
    open(os.path.join(os.environ["HOME"], "notes"), "w").write(os.environ["OPENAI_API_KEY"])
    srv = socket.create_server(("127.0.0.1", cfg["port"]))
    import subprocess
    subprocess.Popen(["sleep", "60"])  # an exec'd child: its /proc environ holds the first's key
    json.dump(res, open(os.path.join(out, "ready.json"), "w"))
    time.sleep(60)
def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
attempt("tmp", lambda: os.listdir("/tmp"))
attempt("other folder", lambda: os.listdir(cfg["other"]))
attempt("other notes", lambda: open(os.path.join(cfg["other"], "home", "notes")).read())
attempt("rollouts", lambda: os.listdir(cfg["rollouts"]))
attempt("other port", lambda: socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2).close())
attempt("pids", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
def keys():
    found = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            found += [v for v in open(path, "rb").read().split(b"\0") if v.startswith(b"OPENAI_API_KEY=")]
        except OSError:
            pass
    return sorted({v.decode() for v in found})
attempt("keys", keys)
json.dump(res, open(os.path.join(out, "probe.json"), "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_attempts_of_one_zygote_cannot_see_each_other(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    script = tmp_path / "neighbours.py"
    script.write_text(NEIGHBOURS)
    harness = HarnessSpec([sys.executable, str(script)], timeout_s=60)
    rollouts, port = tmp_path / "run" / "rollouts", _free_port()
    runner = SandboxedForkServerRunner(preload=[PRELOAD])
    try:
        first_id, first_key = gw.new_rollout()
        first = AttemptSpec(first_id, 0, first_key, gw.url, {"role": "first", "port": port},
                            rollouts / first_id / "attempt-0")  # fmt: skip
        running = asyncio.create_task(runner.run(first, harness))
        deadline = time.monotonic() + 30
        while not (first.workdir / "output" / "ready.json").exists() and time.monotonic() < deadline:
            assert not running.done(), running.result()
            await asyncio.sleep(0.05)
        assert json.loads((first.workdir / "output" / "ready.json").read_text())["preloaded"]
        rid, key = gw.new_rollout()
        task = {"role": "second", "port": port, "other": str(first.workdir), "rollouts": str(rollouts)}
        second = await runner.run(
            AttemptSpec(rid, 0, key, gw.url, task, rollouts / rid / "attempt-0"), harness
        )
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert second.infra_error is None and second.exit_code == 0, second.stderr_tail
        probe = json.loads((second.output_dir / "probe.json").read_text())
        assert runner.starts == 1 and probe["preloaded"] and probe["uid"] >= 2_000_000
        assert probe["tmp"]["ok"] and "first-was-here" not in probe["tmp"]["value"]  # a /tmp of its own
        assert not probe["other folder"]["ok"] and not probe["other notes"]["ok"]
        assert probe["rollouts"] == {"ok": True, "value": [rid]}  # only the way to its own folder
        assert "ConnectionRefused" in probe["other port"]["error"]  # a loopback of its own
        assert probe["pids"]["ok"] and len(probe["pids"]["value"]) <= 3  # init, the harness (and a child)
        assert 1 in probe["pids"]["value"]  # the attempt's own pid namespace, its init (the zygote's child)
        # a forked process's /proc/<pid>/environ shows the zygote's start-up environment (no key at all);
        # what a harness's own exec'd children show is its own key only
        assert probe["keys"]["ok"] and set(probe["keys"]["value"]) <= {f"OPENAI_API_KEY={key}"}
        assert first_key not in json.dumps(probe)
        await _bad_request_is_answered(runner)
    finally:
        runner.close()


async def _bad_request_is_answered(runner: SandboxedForkServerRunner) -> None:
    """A request whose sandbox part is wrong gets `{"error": ...}` and the zygote keeps serving."""
    (zygote,) = runner._zygotes.values()
    for bad, word in ((b'{"kind": "code"}\n', "target"), (b"not json\n", "not JSON")):
        reader, writer = await asyncio.open_unix_connection(str(zygote.socket))
        good = {"kind": "code", "target": "", "args": [], "cwd": "/", "env": {}, "stdout": "/dev/null",
                "stderr": "/dev/null", "uid": None, "sandbox": {"root": "relative"}}  # fmt: skip
        writer.write(bad)
        answer = json.loads(await reader.readline())
        assert word in answer["error"], answer
        writer.close()
        reader, writer = await asyncio.open_unix_connection(str(zygote.socket))
        writer.write(json.dumps(good).encode() + b"\n")
        answer = json.loads(await reader.readline())
        assert answer == {"error": "sandbox.root must be an absolute path"}, answer
        writer.close()
    assert zygote.proc.poll() is None


async def test_a_command_it_cannot_fork_runs_in_the_exec_sandbox(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    code = "import os; open(os.environ['HARNESSRL_OUTPUT'] + '/uid', 'w').write(str(os.getuid()))"
    harness = HarnessSpec([sys.executable, "-u", "-c", code], timeout_s=60)  # -u: an interpreter option
    runner = SandboxedForkServerRunner()
    try:
        rid, key = gw.new_rollout()
        result = await runner.run(
            AttemptSpec(rid, 0, key, gw.url, {}, tmp_path / "run" / rid / "a0"), harness
        )
    finally:
        runner.close()
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    assert runner.starts == 0 and int((result.output_dir / "uid").read_text()) >= 2_000_000
