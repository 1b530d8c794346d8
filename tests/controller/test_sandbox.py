"""The sandboxed runners with real bubblewrap sandboxes, a real gateway and the real OpenAI SDK: each
escape, limit and kill test runs against the exec sandbox (`SandboxRunner`, a bwrap per attempt) and
the sandboxed fork server (`SandboxedForkServerRunner`, attempts forked inside one bwrap).

The escape tests run a probe harness inside the sandbox that tries each way out and records what
happened; every escape must fail, and the one allowed path (the gateway, through the forwarder) must
work. Every address the tests touch belongs to this machine: servers they start themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harnessrl.controller import AttemptResult, Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.runner import AttemptSpec, Runner
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec, find_bwrap
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import AttemptStatus, RolloutState, Task
from tests.support.gateway import GatewayHandle

BWRAP = find_bwrap()


def _namespaces_refused() -> str | None:
    """Why this kernel cannot run the sandbox (None when it can)."""
    if BWRAP is None:
        return None  # a missing bwrap is a failed install, not a reason to skip
    cmd = [BWRAP, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "--proc", "/proc", "true"]
    if os.geteuid() != 0:
        cmd.insert(1, "--unshare-user")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"the kernel refuses namespaces: {r.stderr.strip()}"


_REFUSED = _namespaces_refused()
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")

PROBE = r"""
import json, os, socket, subprocess, sys, urllib.request
cfg = json.load(open(os.environ["HARNESSRL_TASK"]))
out = os.environ["HARNESSRL_OUTPUT"]
res = {}

def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

def connect(host, port):
    socket.create_connection((host, port), timeout=2).close()
    return "connected"

for host in cfg["hosts"]:
    attempt(f"tcp {host}", lambda h=host: connect(h, cfg["port"]))
attempt("tcp gateway port on host address", lambda: connect(cfg["hosts"][-1], cfg["gateway_port"]))
attempt("read secret", lambda: open(cfg["secret"]).read())
def unix(address):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(address)
    return "connected"
attempt("unix socket file", lambda: unix(cfg["unix_path"]))
attempt("unix abstract socket", lambda: unix("\0" + cfg["unix_abstract"]))
for path in cfg["write_targets"]:
    attempt(f"write {path}", lambda p=path: open(p, "w").write("escaped"))
attempt("write private tmp", lambda: open("/tmp/" + cfg["tmp_name"], "w").write("private"))
attempt("plant symlink", lambda: os.symlink(cfg["secret"], os.path.join(out, "leak.txt")))
attempt("write output", lambda: open(os.path.join(out, "answer.txt"), "w").write("42"))
attempt("write home", lambda: open(os.path.join(os.environ["HOME"], "notes"), "w").write("x"))
attempt("read hidden git", lambda: open(cfg["git_config"]).read())
attempt("ls hidden git", lambda: os.listdir(os.path.dirname(cfg["git_config"])))
attempt("run git", lambda: subprocess.run(["git", "--version"], capture_output=True, check=True).stdout.decode())
attempt("run /usr/bin/git", lambda: subprocess.run(["/usr/bin/git", "--version"], check=True).returncode)
attempt("env secret", lambda: os.environ["SECRET_FROM_PARENT"])
base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
def reward():
    req = urllib.request.Request(f"{base}/control/rollouts/{os.environ['HARNESSRL_ROLLOUT_ID']}/reward",
        data=b'{"value": 1.0}', method="PUT", headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=10).status
attempt("write reward", reward)
def chat():
    from openai import OpenAI
    r = OpenAI().chat.completions.create(model="gpt-4o", max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])
    return r.choices[0].finish_reason
attempt("openai sdk", chat)
json.dump(res, open(os.path.join(out, "probe.json"), "w"), indent=1)
"""

LIMITS = r"""
import os, signal, sys, time
out = os.environ["HARNESSRL_OUTPUT"]
log = open(os.path.join(out, "limits.txt"), "w", buffering=1)
children = []
try:
    for _ in range(1000):
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        children.append(pid)
    log.write("forks unbounded\n")
except OSError as e:
    log.write(f"forks {len(children)} {type(e).__name__}\n")
for pid in children:
    os.kill(pid, signal.SIGKILL)
try:
    block = bytearray(1 << 30)
    log.write("allocated 1 GiB\n")
except MemoryError:
    log.write("allocation refused\n")
try:
    with open(os.path.join(out, "big.bin"), "wb") as f:
        f.write(b"x" * (4 << 20))
    log.write("wrote 4 MiB\n")
except OSError as e:
    log.write(f"file capped {e.errno}\n")
log.write("burning cpu\n")
while True:
    pass
"""

GREEDY = r"""
import os, signal, time
pids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        chunks = [bytearray(b"x") * (10 << 20) for _ in range(15)]  # 150 MiB, every page touched
        time.sleep(1)
        os._exit(0)
    pids.append(pid)
killed = sum(os.WTERMSIG(os.waitpid(p, 0)[1]) == signal.SIGKILL for p in pids)
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "killed"), "w").write(str(killed))
"""

HANG = r"""
import os, subprocess, sys, time
marker = open(os.environ["HARNESSRL_TASK"]).read()
subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", marker], start_new_session=True)
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "started"), "w").write("1")
time.sleep(600)
"""


class EchoServer:
    """A TCP server on every address of this machine (IPv4 and IPv6) that the sandbox must not reach."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind(("::", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def host_addresses() -> list[str]:
    """This machine's addresses: loopback first, then those of its links (link-local ones left out).
    The sandbox has no link of its own: its only interface is its own loopback."""
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines() if " scope link" not in line]
    return ["127.0.0.1", "::1"] + [a for a in found if a not in ("127.0.0.1", "::1")]


@pytest.fixture
def server() -> Iterator[EchoServer]:
    srv = EchoServer()
    yield srv
    srv.sock.close()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


MakeRunner = Callable[..., Runner]


@pytest.fixture(params=["exec", "fork"])
def make_runner(request: pytest.FixtureRequest) -> Iterator[MakeRunner]:
    """Builds the runner under test from a SandboxSpec; a forked one must really have forked (a zygote
    started, no fallback to the exec sandbox), checked when the test ends."""
    made: list[Runner] = []

    def make(sandbox: SandboxSpec | None = None) -> Runner:
        sandbox = sandbox or SandboxSpec()
        runner = SandboxRunner(sandbox) if request.param == "exec" else SandboxedForkServerRunner(sandbox)
        made.append(runner)
        return runner

    yield make
    for runner in made:
        runner.close()
        if isinstance(runner, SandboxedForkServerRunner):
            assert runner.starts == 1, "the attempts were not forked from one sandboxed zygote"


async def _attempt(gw: GatewayHandle, tmp_path: Path, runner: Runner, harness: HarnessSpec,
                   task: dict[str, Any], workdir: Path | None = None) -> tuple[str, AttemptResult]:  # fmt: skip
    rid, key = gw.new_rollout()
    spec = AttemptSpec(rid, 0, key, gw.url, task, workdir or tmp_path / "run" / rid / "attempt-0")
    return rid, await runner.run(spec, harness)


async def test_escapes_fail_and_the_gateway_works(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                                  server: EchoServer, monkeypatch: pytest.MonkeyPatch,
                                                  make_runner: MakeRunner) -> None:  # fmt: skip
    monkeypatch.setenv("SECRET_FROM_PARENT", "do-not-leak")
    gw = make_gateway()
    hosts = host_addresses()
    for host in hosts:  # the server is reachable from the host: failing inside means the sandbox held
        socket.create_connection((host, server.port), timeout=2).close()
    secret = _write(tmp_path / "secret" / "secret.txt", "the-answer-is-42")
    unix_path, unix_abstract = str(tmp_path / "host.sock"), f"harnessrl-test-{os.getpid()}"
    unix_servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    for srv, address in zip(unix_servers, (unix_path, "\0" + unix_abstract), strict=True):
        srv.bind(address)
        srv.listen(4)
        with socket.socket(socket.AF_UNIX) as c:  # reachable from the host
            c.connect(address)
    os.chmod(unix_path, 0o777)  # by any uid: only invisibility can stop the sandbox
    workdir = tmp_path / "run" / "r" / "attempt"
    git_config = _write(workdir / "repo" / ".git" / "config", "[core]\n secret = yes\n")
    targets = [str(tmp_path / "escape.txt"), "/etc/harnessrl-escape", str(Path.cwd() / "escape.txt"),
               str(workdir / "escape.txt"), str(Path(sys.executable).parent / "escape")]  # fmt: skip
    tmp_name = f"harnessrl-private-{os.getpid()}"
    task = {"hosts": hosts, "port": server.port, "gateway_port": int(gw.url.rsplit(":", 1)[1]),
            "secret": str(secret), "write_targets": targets, "tmp_name": tmp_name, "git_config": str(git_config),
            "unix_path": unix_path, "unix_abstract": unix_abstract}  # fmt: skip
    harness = HarnessSpec([sys.executable, str(_write(tmp_path / "probe.py", PROBE))], timeout_s=60)
    sandbox = SandboxSpec(hide_git=True, disable_git=True)
    rid, result = await _attempt(gw, tmp_path, make_runner(sandbox), harness, task, workdir)
    for srv in unix_servers:
        srv.close()
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    probe = json.loads((result.output_dir / "probe.json").read_text())
    must_fail = [
        k for k in probe if k.startswith(("tcp", "unix", "read", "run", "env", "write /", "write reward"))
    ]
    assert len(must_fail) >= len(hosts) + 13
    escaped = {k: v for k, v in probe.items() if k in must_fail and v["ok"]}
    assert not escaped, f"escapes that worked: {escaped}"
    assert server.accepted == len(hosts)  # only the host's own sanity connections
    assert "403" in probe["write reward"]["error"] and gw.store.get_reward(rid) is None
    for t in targets:
        assert not Path(t).exists(), f"{t} was written from inside the sandbox"
    assert not Path("/tmp", tmp_name).exists()  # /tmp was private
    assert probe["ls hidden git"] == {"ok": True, "value": []}  # an empty tmpfs over .git
    assert probe["write private tmp"]["ok"] and probe["write output"]["ok"] and probe["write home"]["ok"]
    assert (result.output_dir / "answer.txt").read_text() == "42"
    assert probe["plant symlink"]["ok"] and not (result.output_dir / "leak.txt").is_symlink()  # the grader
    assert "removed 1 symlink" in result.stderr_tail  # running outside would have followed it to the secret
    assert probe["openai sdk"] == {"ok": True, "value": "length"}, probe["openai sdk"]
    assert len(gw.store.calls(rid)) == 1  # the call went through the gateway and was recorded


async def test_the_calc_example_runs_sandboxed(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, make_runner: MakeRunner
) -> None:
    """What the calc example runs (`fork_server: true` under `sandbox: auto`; exec with `fork_server:
    false`): the packaged calc harness (openai SDK, tool calls) through the Controller; it answers (the
    tiny random model is graded 0 or 1) and its calls are recorded."""
    from harnessrl.examples import get_example

    gw = make_gateway(default_max_tokens=8)
    example = get_example("calc")
    client = ControlClient(gw.url, gw.admin_key)
    harness = HarnessSpec(example.harness_command, timeout_s=60)
    task = Task(task_id="t", input={"question": "What is 2 + 3?"}, reference={"answer": "5"})
    try:
        ctl = Controller(client, gw.url, harness, example.grader, tmp_path / "run", runner=make_runner())
        (out,) = await ctl.run([RolloutRequest(task, client_id="calc-0")])
    finally:
        await client.aclose()
    assert out.state == RolloutState.SUCCEEDED and out.reward in (0.0, 1.0), out
    assert gw.store.get_reward(out.rollout_id).details["exit_code"] == 0  # type: ignore[union-attr]
    assert len(gw.store.calls(out.rollout_id)) >= 1


async def test_resource_limits_hold(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                   make_runner: MakeRunner) -> None:  # fmt: skip
    gw = make_gateway()
    sandbox = SandboxSpec(cpu_seconds=1, memory_bytes=512 << 20, max_processes=16, max_file_bytes=1 << 20)
    harness = HarnessSpec([sys.executable, str(_write(tmp_path / "limits.py", LIMITS))], timeout_s=30)
    _, result = await _attempt(gw, tmp_path, make_runner(sandbox), harness, {})
    assert result.infra_error is None and not result.timed_out, result.stderr_tail
    lines = (result.output_dir / "limits.txt").read_text().splitlines()
    forks = lines[0].split()
    assert forks[0] == "forks" and int(forks[1]) < 16 and forks[2] == "BlockingIOError", lines
    assert lines[1:] == ["allocation refused", "file capped 27", "burning cpu"]  # 27 = EFBIG
    assert result.exit_code is not None and result.exit_code >= 128  # killed by RLIMIT_CPU
    if os.geteuid() == 0:  # (other runs on this machine may hold other uids of the range meanwhile)
        script = str(tmp_path / "limits.py")
        assert [pid for pid in _processes_of_uid_range(sandbox) if _cmdline_has(pid, script)] == []


async def test_cgroup_bounds_the_attempt_as_a_whole(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, make_runner: MakeRunner
) -> None:
    """Four processes of 150 MiB each stay under RLIMIT_AS alone; the attempt's 256 MiB cgroup stops them."""
    from harnessrl.controller.runners.cgroups import AttemptCgroup

    probe = AttemptCgroup(1 << 30, 64).create()
    await probe.aclose()
    if not probe.available:
        pytest.skip("this machine lets the controller create no memory+pids cgroup (rlimits still apply)")
    gw = make_gateway()
    sandbox = SandboxSpec(memory_bytes=1 << 30, cgroup="required", cgroup_memory_bytes=256 << 20)
    harness = HarnessSpec([sys.executable, str(_write(tmp_path / "greedy.py", GREEDY))], timeout_s=60)
    _, result = await _attempt(gw, tmp_path, make_runner(sandbox), harness, {})
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    assert int((result.output_dir / "killed").read_text()) >= 1
    assert "memory limit killed" in result.stderr_tail


async def test_timeout_kills_everything(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                       make_runner: MakeRunner) -> None:  # fmt: skip
    gw = make_gateway()
    marker = f"harnessrl-sandbox-marker-{os.getpid()}-{time.monotonic_ns()}"
    harness = HarnessSpec([sys.executable, str(_write(tmp_path / "hang.py", HANG))], timeout_s=3)
    rid, key = gw.new_rollout()
    spec = AttemptSpec(rid, 0, key, gw.url, {}, tmp_path / "run" / rid / "hang")
    result = await make_runner().run(replace(spec, task_input={"m": marker}), harness)
    assert result.timed_out and result.exit_code is None and result.infra_error is None
    assert (result.output_dir / "started").exists()
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _marked(marker), "a process of the sandbox survived its timeout"


async def test_cancel_kills_everything(make_gateway: Callable[..., GatewayHandle], tmp_path: Path,
                                      make_runner: MakeRunner) -> None:  # fmt: skip
    gw = make_gateway()
    marker = f"harnessrl-sandbox-marker-{os.getpid()}-{time.monotonic_ns()}"
    harness = HarnessSpec([sys.executable, str(_write(tmp_path / "hang.py", HANG))], timeout_s=600)
    rid, key = gw.new_rollout()
    spec = AttemptSpec(rid, 0, key, gw.url, {"m": marker}, tmp_path / "run" / rid / "hang")
    task = asyncio.create_task(make_runner().run(spec, harness))
    deadline = time.monotonic() + 30
    while not (spec.workdir / "output" / "started").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _marked(marker), "the harness's detached child should be running before the cancel"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _marked(marker), "a process of the sandbox survived the cancel"


async def test_setup_failure_is_an_infra_error_and_retried(make_gateway: Callable[..., GatewayHandle],
                                                           tmp_path: Path) -> None:  # fmt: skip
    gw = make_gateway()
    client = ControlClient(gw.url, gw.admin_key)
    harness = HarnessSpec([sys.executable, "-c", "import os; open(os.environ['HARNESSRL_OUTPUT'] + '/a', 'w').write('1')"],
                          timeout_s=30)  # fmt: skip

    class FirstSetupFails(SandboxRunner):
        """The first attempt's sandbox cannot start (no bwrap), as on a broken node."""

        calls = 0

        async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
            FirstSetupFails.calls += 1
            broken = replace(self.sandbox, bwrap="/nonexistent/bwrap") if self.calls == 1 else self.sandbox
            return await SandboxRunner(broken).run(spec, harness)

    def grader(task: Task, result: AttemptResult) -> float:
        return float((result.output_dir / "a").exists())

    try:
        ctl = Controller(
            client, gw.url, harness, grader, tmp_path / "run", max_attempts=2, runner=FirstSetupFails()
        )
        (ok,) = await ctl.run([RolloutRequest(Task(task_id="t", input={}), client_id="c0")])
        assert (ok.state, ok.reward) == (RolloutState.SUCCEEDED, 1.0)
        statuses = [a.status for a in gw.store.attempts(ok.rollout_id)]
        assert statuses == [AttemptStatus.INFRA_ERROR, AttemptStatus.EXITED]
        missing = HarnessSpec(["/nonexistent/harness"], timeout_s=30)
        ctl2 = Controller(
            client, gw.url, missing, grader, tmp_path / "run", max_attempts=2, runner=SandboxRunner()
        )
        (lost,) = await ctl2.run([RolloutRequest(Task(task_id="t", input={}), client_id="c1")])
        assert lost.state == RolloutState.FAILED and "sandbox setup failed" in (lost.error or "")
        assert [a.status for a in gw.store.attempts(lost.rollout_id)] == [AttemptStatus.INFRA_ERROR] * 2
    finally:
        await client.aclose()


def _processes_of_uid_range(sandbox: SandboxSpec) -> list[int]:
    """Host pids whose real uid is one of the sandbox's attempt uids."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = int(
                    next(x for x in (d / "status").read_text().splitlines() if x.startswith("Uid:")).split()[
                        1
                    ]
                )
            except (OSError, StopIteration):
                continue
            if sandbox.uid_base <= uid < sandbox.uid_base + sandbox.uid_slots:
                found.append(int(d.name))
    return found


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _marked(marker: str) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False
