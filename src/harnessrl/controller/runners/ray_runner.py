"""The Ray runner: each attempt is a Ray task on whichever node of a Ray cluster fits its resource
request; the files the harness wrote come back to the controller (see docs/ray.md).

How an attempt runs:
- The controller submits `run_on_node` with the attempt's resource request (`RaySpec`), no Ray-level
  retries (the Controller retries an infrastructure failure as a new attempt) and a deadline of the
  harness's time limit plus `RaySpec.overhead_s` (scheduling, start-up, transfer).
- On the node, the task makes a private directory under the node's temp dir and runs the attempt
  there with the ordinary `LocalRunner` (or `SandboxRunner`), so the contract environment, the time
  limit, the process-group kill and the output tails are the same as on one machine.
- With `LocalRunner` the harness is started through a small guard (`GUARD`) that leaves a watcher in
  a session of its own: if the Ray worker dies (`ray.cancel(force=True)`, a crash, the node's raylet
  gone), the watcher kills the harness's whole process group. A detached janitor (`JANITOR`) removes
  the node-side directory in that case (the task's own clean-up cannot run). The sandbox
  needs no guard: bwrap runs with `--die-with-parent` and a pid namespace.
- The task returns the exit code, time-out flag, output tails and the output directory's regular
  files (size-capped); the controller writes those into the attempt's local `output/`, so graders
  read `AttemptResult.output_dir` as with any runner.
- A Ray failure (node died, worker crashed, object lost, task could not be scheduled in time, an
  exception in the task itself) is `AttemptResult.infra_error`; the harness's own exit or time-out is a
  result. Cancelling `run` cancels the task with `force=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from harnessrl.controller.runner import (
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    RunnerBase,
    pack_home,
    prepare_workdir,
    unpack_home,
)
from harnessrl.controller.runners.local import LocalRunner
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec

if TYPE_CHECKING:
    from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

GUARD_MARK = "harnessrl-ray-guard:"
NODE_ID_ENV = "HARNESSRL_RAY_NODE_ID"  # given to the harness: the Ray node it runs on
_CONNECT_LOCK = threading.Lock()

# The guard: argv = [worker_pid, harness command...], run as the attempt's process-group leader. It
# forks a watcher into a session of its own (out of reach of Ray's clean-up of the worker's children
# and process group), then becomes the harness (exec). The watcher waits for the harness or the Ray
# worker to end, then kills the harness's process group.
GUARD = r"""
import os, select, signal, sys
worker_pid, cmd = int(sys.argv[1]), sys.argv[2:]
group = os.getpgid(0)
ready_r, ready_w = os.pipe()
if os.fork() == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    harness = os.pidfd_open(os.getppid())
    try:
        worker = os.pidfd_open(worker_pid)
    except ProcessLookupError:
        worker = None
    os.close(ready_w)
    if worker is not None:
        select.select([worker, harness], [], [])
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    os._exit(0)
os.close(ready_w)
os.read(ready_r, 1)  # returns once the watcher is in its own session and watching
try:
    os.execvp(cmd[0], cmd)
except OSError as e:
    sys.stderr.write("GUARD_MARK could not start harness: %s\n" % e)
    sys.exit(127)
""".replace("GUARD_MARK", GUARD_MARK)

# The janitor: argv = [node_workdir]; stdin is a pipe from the Ray task. Detached (double fork, its own
# session), it removes the directory if the pipe closes without a word: the worker died mid-attempt.
JANITOR = r"""
import os, shutil, sys, time
if os.fork() != 0:
    os._exit(0)
os.setsid()
if sys.stdin.buffer.read(1) == b"":
    time.sleep(1.0)  # let the harness's group be killed first
    shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


@dataclass(frozen=True)
class RaySpec:
    """Where and how attempts run on Ray: the cluster address and each attempt's resource request."""

    address: str | None = "auto"  # "auto" (RAY_ADDRESS or a local `ray start`), "host:port", "ray://…"
    num_cpus: float = 1.0  # logical CPUs reserved per attempt (scheduling, not enforcement)
    memory_bytes: int | None = None  # logical memory reserved per attempt (scheduling only)
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"harness": 1}
    namespace: str | None = None
    runtime_env: dict[str, Any] | None = None  # passed to ray.init (e.g. env_vars, py_modules)
    overhead_s: float = 600.0  # allowance beyond the harness's timeout: scheduling, start-up, transfer
    max_file_bytes: int = 16 << 20  # larger output files are not brought back
    max_total_bytes: int = 64 << 20  # the output files brought back per attempt, in all
    node_workdir: str | None = None  # base of the per-attempt directory on the node (default: its temp)
    keep_node_workdir: bool = False  # keep that directory after the attempt (debugging)
    sandbox: SandboxSpec | None = None  # run the attempt on the node with SandboxRunner


@dataclass(frozen=True)
class NodeResult:
    """What a Ray task returns: the attempt's outcome, its output files and where it ran."""

    exit_code: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    infra_error: str | None
    files: dict[str, bytes]
    skipped: list[str]
    node_id: str
    hostname: str
    guard_findings: dict[str, Any] | None = None  # what the inner runner's guard check found


def collect_files(
    output_dir: Path, max_file_bytes: int, max_total_bytes: int
) -> tuple[dict[str, bytes], list[str]]:
    """The regular files under `output_dir` by relative POSIX path, and the paths left out (too big,
    over the total, or not a regular file: symlinks are never followed)."""
    files: dict[str, bytes] = {}
    skipped: list[str] = []
    total = 0
    for root, dirs, names in os.walk(output_dir, followlinks=False):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(output_dir).as_posix()
            if path.is_symlink() or not path.is_file():
                skipped.append(f"{rel} (not a regular file)")
                continue
            size = path.stat().st_size
            if size > max_file_bytes or total + size > max_total_bytes:
                skipped.append(f"{rel} ({size} bytes, over the limit)")
                continue
            files[rel] = path.read_bytes()
            total += size
    return files, skipped


def write_files(output_dir: Path, files: dict[str, bytes]) -> None:
    """Write returned output files under `output_dir`, refusing paths that would leave it."""
    for rel, data in files.items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            log.warning("event=ray_output_path_refused path=%r", rel)
            continue
        target = output_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def run_on_node(
    spec: AttemptSpec, harness: HarnessSpec, ray_spec: RaySpec, node_id: str, home: bytes = b""
) -> NodeResult:
    """The body of the Ray task: run one attempt on this node in a private directory whose `home/` gets
    the controller's copy of the attempt's `home/` (`home`: `pack_home`'s archive); return its outcome."""
    base = ray_spec.node_workdir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"harnessrl-{spec.rollout_id}-a{spec.attempt}-", dir=base))
    workdir.chmod(0o755)  # as the local runners' directories: the sandbox's attempt uid must enter it
    janitor = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", JANITOR, str(workdir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    janitor.wait()  # its detached grandchild holds the pipe's read end
    node_spec = dataclasses.replace(spec, workdir=workdir)
    unpack_home(home, workdir)  # harness.files, where every runner puts them
    env = {**harness.env, NODE_ID_ENV: node_id}
    try:
        if ray_spec.sandbox is not None:
            result = asyncio.run(
                SandboxRunner(ray_spec.sandbox).run(node_spec, dataclasses.replace(harness, env=env))
            )
        else:
            result = asyncio.run(LocalRunner().run(node_spec, guarded(harness, env)))
        infra_error = result.infra_error
        if infra_error is None and result.exit_code == 127 and GUARD_MARK in result.stderr_tail:
            infra_error = result.stderr_tail[result.stderr_tail.index(GUARD_MARK) + len(GUARD_MARK) :].strip()
        files, skipped = collect_files(result.output_dir, ray_spec.max_file_bytes, ray_spec.max_total_bytes)
        return NodeResult(
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            stdout_tail=result.stdout_tail,
            stderr_tail=result.stderr_tail,
            infra_error=infra_error,
            files=files,
            skipped=skipped,
            node_id=node_id,
            hostname=socket.gethostname(),
            guard_findings=result.guard_findings,
        )
    finally:
        if not ray_spec.keep_node_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        # Only now tell the janitor it is not needed: Ray may kill this worker at any point above
        # (a forced cancel kills the harness first, so this code can still be running).
        assert janitor.stdin is not None
        with contextlib.suppress(OSError):
            janitor.stdin.write(b"done")
            janitor.stdin.close()


def guarded(harness: HarnessSpec, env: dict[str, str]) -> HarnessSpec:
    """The harness command wrapped in the guard that kills its process group if this worker dies."""
    command = [sys.executable, "-I", "-S", "-c", GUARD, str(os.getpid()), *harness.command]
    return dataclasses.replace(harness, command=command, env=env)


def _ray_task(spec: AttemptSpec, harness: HarnessSpec, ray_spec: RaySpec, home: bytes) -> NodeResult:
    import ray

    return run_on_node(spec, harness, ray_spec, ray.get_runtime_context().get_node_id(), home)


class RayRunner(RunnerBase):
    """Runs each attempt as a Ray task on a Ray cluster; output files come back to the controller."""

    def __init__(self, ray_spec: RaySpec | None = None) -> None:
        self.ray_spec = ray_spec or RaySpec()
        self._remote: Any = None
        self._connected_here = False

    def connect(self) -> None:
        """Connect to the cluster (once; a no-op if this process is already connected)."""
        import ray

        with _CONNECT_LOCK:  # ray.init is per process; concurrent first attempts must not race
            if not ray.is_initialized():
                ray.init(
                    address=self.ray_spec.address,
                    namespace=self.ray_spec.namespace,
                    runtime_env=self.ray_spec.runtime_env,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
                self._connected_here = True
                log.info("event=ray_connected address=%s", self.ray_spec.address)
            if self._remote is None:
                self._remote = ray.remote(_ray_task)

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """What the inner runner on the node says: the sandbox enforces a guard, the plain runner
        checks read-only paths only."""
        inner = SandboxRunner(self.ray_spec.sandbox) if self.ray_spec.sandbox is not None else LocalRunner()
        return inner.guard_problem(guard)

    def close(self) -> None:
        """Disconnect from the cluster if this runner connected."""
        import ray

        if self._connected_here:
            ray.shutdown()
            self._connected_here = False
            self._remote = None

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt as a Ray task and bring its output back (a Ray failure is `infra_error`)."""
        import ray

        output_dir, _ = prepare_workdir(spec)
        if self._remote is None:
            await asyncio.to_thread(self.connect)
        rs = self.ray_spec
        options: dict[str, Any] = {
            "num_cpus": rs.num_cpus,
            "resources": dict(rs.resources),
            "max_retries": 0,
            "retry_exceptions": False,
            "name": f"harnessrl-attempt:{spec.rollout_id}:{spec.attempt}",
        }
        if rs.memory_bytes is not None:
            options["memory"] = rs.memory_bytes
        ref = self._remote.options(**options).remote(spec, harness, rs, pack_home(spec.workdir))
        deadline = harness.timeout_s + rs.overhead_s
        try:
            async with asyncio.timeout(deadline):
                node: NodeResult = await ref
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)
            log.info("event=ray_attempt_cancelled rollout=%s attempt=%d", spec.rollout_id, spec.attempt)
            raise
        except TimeoutError:
            ray.cancel(ref, force=True)
            return self._infra(spec, output_dir, f"ray task did not finish within {deadline:.0f}s")
        except ray.exceptions.RayError as e:
            return self._infra(spec, output_dir, f"ray: {type(e).__name__}: {str(e)[:2000]}")
        write_files(output_dir, node.files)
        (spec.workdir / "stdout.txt").write_text(node.stdout_tail)
        (spec.workdir / "stderr.txt").write_text(node.stderr_tail)
        if node.skipped:
            log.warning(
                "event=ray_output_skipped rollout=%s attempt=%d files=%s",
                spec.rollout_id,
                spec.attempt,
                node.skipped,
            )
        log.info("event=ray_attempt_done rollout=%s attempt=%d node=%s host=%s exit=%s timed_out=%s",
                 spec.rollout_id, spec.attempt, node.node_id, node.hostname, node.exit_code, node.timed_out)  # fmt: skip
        return AttemptResult(
            exit_code=node.exit_code,
            timed_out=node.timed_out,
            output_dir=output_dir,
            stdout_tail=node.stdout_tail,
            stderr_tail=node.stderr_tail,
            infra_error=node.infra_error,
            guard_findings=node.guard_findings,
        )

    @staticmethod
    def _infra(spec: AttemptSpec, output_dir: Path, error: str) -> AttemptResult:
        log.warning(
            "event=ray_attempt_infra_error rollout=%s attempt=%d error=%s",
            spec.rollout_id,
            spec.attempt,
            error,
        )
        return AttemptResult(None, False, output_dir, "", "", infra_error=error)
