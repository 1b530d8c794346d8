"""The runner contract shared by every backend (`runners/`): what an attempt is (`AttemptSpec`), how a
harness is started (`HarnessSpec`), what an attempt gives back (`AttemptResult`), the `Runner` protocol
with its lifecycle (`start`, `run`, `resume`, `close`; `RunnerBase` gives the defaults), the harness
contract's environment, and the process bookkeeping a restarted controller uses to find what is left
of an attempt."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

# Variables a harness may inherit from the controller's environment; everything else is scrubbed.
DEFAULT_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "HF_HUB_OFFLINE")


def inherited_env(names: tuple[str, ...]) -> dict[str, str]:
    """The controller's values of `names`, with PYTHONPATH's relative entries made absolute against the
    controller's working directory: a harness runs in its attempt's folder, where `PYTHONPATH=src` (as
    typed in a checkout) would name nothing."""
    env = {k: os.environ[k] for k in names if k in os.environ}
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) if p else p for p in env["PYTHONPATH"].split(os.pathsep)
        )
    return env


@dataclass(frozen=True)
class HarnessSpec:
    """How to start a harness: the command, its time limit and extra environment."""

    command: list[str]
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH
    max_output_bytes: int = 1_000_000  # stdout/stderr kept per attempt
    files: tuple[Path, ...] = ()  # files/folders copied into each attempt's home/ before it starts


def attempt_home(workdir: Path) -> Path:
    """An attempt's `home/`: its working directory and `HOME` in every runner, where `harness.files`
    are copied (docs/your-harness.md, "Where an attempt runs")."""
    return workdir / "home"


def copy_files(files: tuple[Path, ...], workdir: Path) -> None:
    """Copy the harness's declared files into an attempt's `home/` (symlinks copied as links, not
    followed); an existing copy (a retried attempt's folder) is replaced."""
    home = attempt_home(workdir)
    home.mkdir(parents=True, exist_ok=True)
    for src in files:
        dst = home / src.name
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


def pack_home(workdir: Path) -> bytes:
    """The attempt's `home/` as it stands before the harness starts (the copied `harness.files`), as
    a tar.gz for a runner that runs the attempt elsewhere (Ray, Kubernetes); b"" when it is empty."""
    home = attempt_home(workdir)
    if not home.is_dir() or not any(home.iterdir()):
        return b""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for entry in sorted(home.iterdir()):
            tar.add(entry, arcname=entry.name)  # links stay links, modes are kept
    return buf.getvalue()


def unpack_home(data: bytes, workdir: Path) -> None:
    """Unpack `pack_home`'s archive into an attempt's `home/` (no absolute paths, no escapes)."""
    home = attempt_home(workdir)
    home.mkdir(parents=True, exist_ok=True)
    if data:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(home, filter="data")


@dataclass(frozen=True)
class AttemptSpec:
    """One attempt to run: which rollout, its key, its task input, where to put its files."""

    rollout_id: str
    attempt: int
    api_key: str
    gateway_url: str
    task_input: dict[str, Any]
    workdir: Path
    guard: GuardPolicy | None = None  # what the task lets the harness touch (controller/guard.py)


@dataclass(frozen=True)
class AttemptResult:
    """What happened: exit code (None if killed), whether it timed out, the output directory."""

    exit_code: int | None
    timed_out: bool
    output_dir: Path
    stdout_tail: str
    stderr_tail: str
    infra_error: str | None = None
    # what a runner that checks (not blocks) the task's guard found, e.g. read-only files changed;
    # the controller adds it to the reward's details["hacking"]["guard"]
    guard_findings: dict[str, Any] | None = None


def contract_env(
    spec: AttemptSpec, harness: HarnessSpec, task_file: Path, output_dir: Path
) -> dict[str, str]:
    """The harness contract: base URLs and the rollout's key for both APIs, task file, output dir."""
    env = inherited_env(harness.passthrough)
    base = spec.gateway_url.rstrip("/")
    env.update(
        {
            "HOME": str(attempt_home(spec.workdir)),
            "OPENAI_BASE_URL": f"{base}/v1",
            "OPENAI_API_KEY": spec.api_key,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": spec.api_key,
            "ANTHROPIC_AUTH_TOKEN": spec.api_key,
            "HARNESSRL_ROLLOUT_ID": spec.rollout_id,
            "HARNESSRL_TASK": str(task_file),
            "HARNESSRL_OUTPUT": str(output_dir),
        }
    )
    env.update(harness.env)
    return env


class Runner(Protocol):
    """Runs attempts of a harness. The lifecycle the controller, `run` and `check` rely on: `start` once
    before the first attempt (a runner that cannot work fails there, not per attempt), `run` per attempt,
    `resume` for an attempt a dead controller left running, `close` once at the end."""

    async def start(self) -> None:
        """Get ready to run attempts (e.g. start a fork server, connect to a cluster)."""
        ...

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end (exit, timeout, or failure to start)."""
        ...

    async def resume(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult | None:
        """Reattach to an attempt started by a controller that died and wait for its end; None when this
        runner cannot (the controller then kills what is left of it and records an infrastructure
        failure)."""
        ...

    def close(self) -> None:
        """Release what `start` took; no attempt runs after it."""
        ...

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """Why this runner cannot enforce (or check) a task's `guard`, or None when it can; the
        controller refuses to start a run with such a task (docs/security.md, Guards)."""
        ...


class RunnerBase:
    """Defaults of the `Runner` lifecycle for a runner that needs no setup and cannot reattach."""

    async def start(self) -> None:
        """Nothing to get ready."""

    async def resume(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult | None:
        """A local attempt cannot be reattached: None."""
        return None

    def close(self) -> None:
        """Nothing to release."""

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """A runner that enforces no guard refuses every non-empty one."""
        if guard is None or guard.empty:
            return None
        return f"{type(self).__name__} enforces no guard (hidden, read_only, egress); use the local or Ray runner"


def prepare_workdir(spec: AttemptSpec) -> tuple[Path, Path]:
    """Create the attempt's directory, its `home/`, `output/` and `task.json`; return (output_dir, task_file)."""
    attempt_home(spec.workdir).mkdir(parents=True, exist_ok=True)
    output_dir = spec.workdir / "output"
    output_dir.mkdir(exist_ok=True)
    task_file = spec.workdir / "task.json"
    task_file.write_text(json.dumps(spec.task_input))
    return output_dir, task_file


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def record_process(workdir: Path, pid: int) -> None:
    """Write `runner.json` (pid = process group, start time) so a restarted controller can find it."""
    (workdir / "runner.json").write_text(json.dumps({"pgid": pid, "start_time": _start_time(pid)}))


def reap_attempt(workdir: Path) -> bool:
    """Kill what is left of an attempt whose controller died (its recorded process group, if that
    process is still the one recorded — a reused pid is left alone). True if something was killed."""
    try:
        info = json.loads((workdir / "runner.json").read_text())
    except (OSError, ValueError):
        return False
    pgid = int(info["pgid"])
    start = _start_time(pgid)
    if start is not None and start != info.get("start_time"):
        return False  # the pid now belongs to another process
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL a whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def tail(path: Path, limit: int) -> str:
    """The last `limit` bytes of a file, decoded as UTF-8."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # never a link planted in the attempt's folder
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            f.seek(size - limit)
        return f.read().decode("utf-8", errors="replace")
