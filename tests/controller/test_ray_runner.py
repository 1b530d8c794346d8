"""The Ray runner on a real local multi-process Ray cluster (a head node plus worker nodes on this
machine, each started with `ray start --block` in a session of its own): placement by resource
request, output files coming back to a grader, exit codes and time-outs as results, a node killed
mid-attempt retried by the Controller on a replacement node, cancellation killing the harness."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harnessrl.controller import AttemptResult, AttemptSpec, Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.runners.ray_runner import RayRunner, RaySpec, collect_files, write_files
from harnessrl.controller.runners.sandbox import SandboxSpec, find_bwrap
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import AttemptStatus, RewardIn, RolloutState, Task
from harnessrl.services import free_port
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer

RAY_BIN = Path(sys.executable).with_name("ray")
needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or not RAY_BIN.exists(), reason="ray is not installed"
)
# Ray's own node processes cannot start from an installation whose path has a space (seen with 2.60.0
# from a clone in "/tmp/ci run12/": `ray start` runs its servers through a shell and LD_PRELOAD, which
# split the path: "bash: /tmp/ci: No such file or directory", the GCS never comes up); docs/ray.md
ray_path_ok = pytest.mark.skipif(
    any(c.isspace() for c in str(RAY_BIN)),
    reason=f"Ray cannot start nodes from a path with a space: {RAY_BIN}",
)

HARNESS = r"""
import json, os, subprocess, sys, time
task = json.load(open(os.environ["HARNESSRL_TASK"]))
out = os.environ["HARNESSRL_OUTPUT"]
where = {"node": os.environ.get("HARNESSRL_RAY_NODE_ID"), "cwd": os.getcwd(),
         "base_url": os.environ["OPENAI_BASE_URL"], "rollout": os.environ["HARNESSRL_ROLLOUT_ID"]}
json.dump(where, open(os.path.join(out, "where.json"), "w"))
mode = task["mode"]
if mode == "hang-once" and os.path.exists(task["mark"]):
    mode = "ok"
if mode == "ok":
    os.makedirs(os.path.join(out, "sub"), exist_ok=True)
    open(os.path.join(out, "sub", "answer.txt"), "w").write("42")
elif mode == "crash":
    raise SystemExit(3)
elif mode in ("hang", "hang-once"):
    open(task.get("mark", os.devnull), "w").close()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", task.get("token", "-")])
    if "pidfile" in task:
        tmp = task["pidfile"] + ".tmp"
        open(task["pidfile"] + ".cwd", "w").write(os.getcwd())
        open(tmp, "w").write(f"{os.getpid()} {child.pid}")
        os.replace(tmp, task["pidfile"])
    time.sleep(600)
"""


@dataclass
class RayNode:
    """One `ray start --block` process group: a node of the test cluster."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_started(self, timeout: float = 120) -> None:
        """Block until the node says it started; fail with its log if it exits first."""
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the node's whole process group (its raylet, and with it its workers)."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class RayCluster:
    """A local Ray cluster on this machine: its GCS address and nodes by name."""

    root: Path
    port: int
    nodes: dict[str, RayNode] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """The address ray.init connects to."""
        return f"127.0.0.1:{self.port}"

    def start_node(
        self, name: str, num_cpus: int, resources: dict[str, float], head: bool = False
    ) -> RayNode:
        """Start a node (without waiting for it) with its own temp dir and free ports."""
        args = [str(RAY_BIN), "start", "--block", "--disable-usage-stats", "--num-cpus", str(num_cpus),
                "--resources", json.dumps(resources), "--temp-dir", str(self.root / name),
                "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]  # fmt: skip
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard=false",
                     "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port())]  # fmt: skip
        else:
            args += ["--address", self.address]
        log = self.root / f"{name}.log"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        node = self.nodes[name] = RayNode(name, proc, log)
        return node

    def add_node(self, name: str, num_cpus: int, resources: dict[str, float]) -> RayNode:
        """Start a node and wait until it has started."""
        node = self.start_node(name, num_cpus, resources)
        node.wait_started()
        return node


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def node_ids(resource: str) -> list[str]:
    """The ids of the alive nodes offering a custom resource."""
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]


def _sandbox_refused() -> str | None:
    """Why the sandbox cannot run here (None when it can)."""
    bwrap = find_bwrap()
    if bwrap is None:
        return "no bwrap"
    cmd = [bwrap, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "--proc", "/proc", "true"]
    if os.geteuid() != 0:
        cmd.insert(1, "--unshare-user")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"the kernel refuses namespaces: {r.stderr.strip()}"


def pids_with(token: str) -> list[int]:
    """The live processes whose command line contains `token`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return [p for p in found if alive(p)]


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_gone(pids: list[int], timeout: float = 20) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return [p for p in pids if alive(p)]


async def read_pids(path: Path, timeout: float = 60) -> list[int]:
    """Wait for a harness's pid file and return its pids."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the harness never wrote its pid file"
        await asyncio.sleep(0.1)
    return [int(p) for p in path.read_text().split()]


@pytest.fixture(scope="module")  # three Ray nodes: stopped when this module is done, not kept idle
def ray_cluster() -> Iterator[RayCluster]:
    """A head (1 CPU, {"head": 1}), a worker ({"worker": 1}) and a node to lose ({"doomed": 1})."""
    import ray

    root = Path(tempfile.mkdtemp(prefix="hrlray-"))  # short: Ray's socket paths live under it
    cluster = RayCluster(root, free_port())
    try:
        nodes = [
            cluster.start_node("head", 1, {"head": 1}, head=True),
            cluster.start_node("worker", 2, {"worker": 1}),
            cluster.start_node("doomed", 1, {"doomed": 1}),
        ]
        for node in nodes:
            node.wait_started()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in cluster.nodes.values():  # the raylets' workers exit when their raylet is gone
            node.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def runner(ray_cluster: RayCluster) -> RayRunner:
    """A runner whose attempts must land on the worker node."""
    return RayRunner(RaySpec(address=ray_cluster.address, num_cpus=0.5, resources={"worker": 0.1}))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, str, SQLiteStore]]:
    """A real gateway on loopback over a SQLite store (no engine: these harnesses make no calls)."""
    admin_key = "admin-" + secrets.token_hex(8)
    store = SQLiteStore(tmp_path / "store.sqlite")
    cfg = GatewayConfig.model_validate({"admin_key": admin_key, "upstream_url": "http://127.0.0.1:9"})
    with ThreadServer(create_app(cfg, store)) as srv:
        yield srv.url, admin_key, store


def grader(task: Task, result: AttemptResult) -> RewardIn:
    """1.0 when the harness's answer came back to the controller's output directory."""
    answer = result.output_dir / "sub" / "answer.txt"
    return RewardIn(value=float(answer.exists() and answer.read_text() == "42"))


def harness_spec(tmp_path: Path, timeout_s: float = 60) -> HarnessSpec:
    """The test harness as a HarnessSpec."""
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    return HarnessSpec(command=[sys.executable, str(path)], timeout_s=timeout_s)


def attempt(tmp_path: Path, task_input: dict[str, Any], name: str = "r") -> AttemptSpec:
    """An attempt for the runner alone (no gateway behind the URL)."""
    return AttemptSpec(name, 0, "hrl-key", "http://127.0.0.1:9", task_input, tmp_path / "run" / name)


def test_output_files_come_back_within_limits(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a.txt").write_bytes(b"a" * 10)
    (src / "big.bin").write_bytes(b"b" * 100)
    (src / "link").symlink_to("/etc/hostname")
    files, skipped = collect_files(src, max_file_bytes=50, max_total_bytes=1000)
    assert files == {"d/a.txt": b"a" * 10}
    assert sorted(s.split()[0] for s in skipped) == ["big.bin", "link"]
    dest = tmp_path / "dest"
    write_files(dest, {**files, "../escape.txt": b"x", "/abs.txt": b"y"})
    assert (dest / "d" / "a.txt").read_bytes() == b"a" * 10
    assert not (tmp_path / "escape.txt").exists() and sorted(p.name for p in dest.iterdir()) == ["d"]


@needs_ray
@ray_path_ok
async def test_placement_output_and_exit_codes(
    ray_cluster: RayCluster, runner: RayRunner, gateway: tuple[str, str, SQLiteStore], tmp_path: Path
) -> None:
    url, admin_key, store = gateway
    client = ControlClient(url, admin_key)
    ctl = Controller(client, url, harness_spec(tmp_path), grader, tmp_path / "run", runner=runner)
    reqs = [RolloutRequest(Task(task_id=m, input={"mode": m}), client_id=m) for m in ("ok", "crash")]
    try:
        ok, crash = await ctl.run(reqs)
    finally:
        await client.aclose()
    assert (ok.state, ok.reward) == (RolloutState.SUCCEEDED, 1.0)  # the grader read the returned file
    assert (crash.state, crash.reward) == (RolloutState.SUCCEEDED, 0.0)  # a harness's exit is a result
    assert store.get_reward(crash.rollout_id).details["exit_code"] == 3  # type: ignore[union-attr]
    assert [a.status for a in store.attempts(crash.rollout_id)] == [AttemptStatus.EXITED]
    where = json.loads(
        (tmp_path / "run/rollouts" / ok.rollout_id / "attempt-0/output/where.json").read_text()
    )
    assert where["node"] in node_ids("worker") and where["node"] not in node_ids("head")  # placement
    assert where["base_url"] == f"{url}/v1" and where["rollout"] == ok.rollout_id  # the contract
    assert not str(where["cwd"]).startswith(str(tmp_path)) and not Path(where["cwd"]).exists()


@needs_ray
@ray_path_ok
async def test_timeout_kills_the_harness_and_a_missing_command_is_infra(
    runner: RayRunner, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pids"
    result = await runner.run(
        attempt(tmp_path, {"mode": "hang", "pidfile": str(pidfile)}), harness_spec(tmp_path, 2)
    )
    assert (result.timed_out, result.exit_code, result.infra_error) == (True, None, None)
    assert (result.output_dir / "where.json").exists()
    assert await wait_gone(await read_pids(pidfile, timeout=1)) == []
    missing = HarnessSpec(command=[str(tmp_path / "no-such-harness")], timeout_s=10)
    result = await runner.run(attempt(tmp_path, {}, "r2"), missing)
    assert result.infra_error is not None and "could not start harness" in result.infra_error


@needs_ray
@ray_path_ok
async def test_cancel_kills_the_harness(runner: RayRunner, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    run = asyncio.create_task(
        runner.run(attempt(tmp_path, {"mode": "hang", "pidfile": str(pidfile)}), harness_spec(tmp_path))
    )
    pids = await read_pids(pidfile)
    node_dir = Path(Path(f"{pidfile}.cwd").read_text())
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert await wait_gone(pids) == []
    deadline = time.monotonic() + 20
    while node_dir.exists():  # the janitor removes the attempt's directory on the node
        assert time.monotonic() < deadline, f"{node_dir} was left behind"
        await asyncio.sleep(0.1)


@pytest.mark.slow  # heavy for the suite's 15 minutes: `pytest -m slow` runs it
@needs_ray
@ray_path_ok
async def test_node_loss_is_retried_on_a_new_node(
    ray_cluster: RayCluster, gateway: tuple[str, str, SQLiteStore], tmp_path: Path
) -> None:
    url, admin_key, store = gateway
    runner = RayRunner(RaySpec(address=ray_cluster.address, num_cpus=0.5, resources={"doomed": 0.1}))
    client = ControlClient(url, admin_key)
    ctl = Controller(
        client, url, harness_spec(tmp_path), grader, tmp_path / "run", max_attempts=2, runner=runner
    )
    pidfile, mark = tmp_path / "pids", tmp_path / "first-attempt"
    task = Task(task_id="t", input={"mode": "hang-once", "pidfile": str(pidfile), "mark": str(mark)})
    try:
        run = asyncio.create_task(ctl.run([RolloutRequest(task, client_id="lost")]))
        pids = await read_pids(pidfile)
        lost = node_ids("doomed")
        ray_cluster.nodes["doomed"].kill()
        await asyncio.to_thread(ray_cluster.add_node, "doomed-2", 1, {"doomed": 1})
        (outcome,) = await asyncio.wait_for(run, timeout=120)
    finally:
        await client.aclose()
    assert (outcome.state, outcome.reward) == (RolloutState.SUCCEEDED, 1.0)
    first, second = store.attempts(outcome.rollout_id)
    assert first.status == AttemptStatus.INFRA_ERROR and "NodeDiedError" in (first.error or "")
    assert second.status == AttemptStatus.EXITED
    assert await wait_gone(pids) == []  # the lost node's harness did not outlive its worker
    out = tmp_path / "run/rollouts" / outcome.rollout_id / f"attempt-{second.attempt}/output"
    where = json.loads((out / "where.json").read_text())
    assert where["node"] not in lost and where["node"] in node_ids("doomed")


@needs_ray
@ray_path_ok
async def test_sandboxed_attempt_on_a_node(ray_cluster: RayCluster, tmp_path: Path) -> None:
    refused = _sandbox_refused()
    if refused is not None:
        pytest.skip(refused)
    spec = RaySpec(
        address=ray_cluster.address, num_cpus=0.5, resources={"worker": 0.1}, sandbox=SandboxSpec()
    )
    runner = RayRunner(spec)
    ok = await runner.run(attempt(tmp_path, {"mode": "ok"}), harness_spec(tmp_path))
    assert (ok.exit_code, ok.infra_error) == (0, None), ok.stderr_tail
    assert (ok.output_dir / "sub" / "answer.txt").read_text() == "42"
    token = "hrl-" + secrets.token_hex(8)  # pids inside the sandbox are not the host's: find it by token
    run = asyncio.create_task(
        runner.run(attempt(tmp_path, {"mode": "hang", "token": token}, "r2"), harness_spec(tmp_path))
    )
    deadline = time.monotonic() + 60
    while not (pids := pids_with(token)):
        assert time.monotonic() < deadline, "the sandboxed harness never started"
        await asyncio.sleep(0.1)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert await wait_gone(pids) == []


@needs_ray
@ray_path_ok
async def test_harness_files_reach_the_node_in_its_working_directory(
    runner: RayRunner, tmp_path: Path
) -> None:
    """Through a real cluster: the controller's copy of `harness.files` arrives in the node-side `home/`,
    the harness's working directory (docs/your-harness.md, "Where an attempt runs")."""
    from harnessrl.controller.runner import copy_files
    from tests.controller.test_harness_files import HARNESS, _check

    (tmp_path / "harness.py").write_text(HARNESS)
    (tmp_path / "data.txt").write_text("forty two\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "settings.json").write_text('{"n": 42}')
    (tmp_path / "tool.sh").write_text("#!/bin/sh\n")
    (tmp_path / "tool.sh").chmod(0o755)
    files = tuple(tmp_path / n for n in ("harness.py", "data.txt", "conf", "tool.sh"))
    spec = AttemptSpec(
        "files", 0, "hrl-key", "http://127.0.0.1:9", {"question": "q?"}, tmp_path / "run" / "files"
    )
    copy_files(files, spec.workdir)  # as the Controller does before `run`
    result = await runner.run(spec, HarnessSpec([sys.executable, "harness.py"], timeout_s=60, files=files))
    assert result.infra_error is None and result.exit_code == 0, result
    where = json.loads((result.output_dir / "where.json").read_text())
    _check(where, result.output_dir)
    assert not where["cwd"].startswith(str(tmp_path))  # the node's folder, not the controller's
