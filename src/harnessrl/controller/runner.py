"""The local runner: one subprocess per attempt, the harness contract in its environment, a timeout
that kills the whole process group; as root, the harness runs under a uid of its own (`isolation.py`),
and after every attempt `output/` is cleaned of links the grader must not follow."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from harnessrl.controller.isolation import (
    IsolationError,
    attempt_identity,
    drop_to,
    finish_attempt,
)
from harnessrl.services import die_with_parent

log = logging.getLogger(__name__)

# Variables a harness may inherit from the controller's environment; everything else is scrubbed.
DEFAULT_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "HF_HUB_OFFLINE")


@dataclass(frozen=True)
class HarnessSpec:
    """How to start a harness: the command, its time limit and extra environment."""

    command: list[str]
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH
    max_output_bytes: int = 1_000_000  # stdout/stderr kept per attempt
    files: tuple[Path, ...] = ()  # files/folders copied into each attempt's workdir before it starts


def copy_files(files: tuple[Path, ...], workdir: Path) -> None:
    """Copy the harness's declared files into an attempt's workdir (symlinks copied as links, not
    followed); an existing copy (a retried attempt's folder) is replaced."""
    workdir.mkdir(parents=True, exist_ok=True)
    for src in files:
        dst = workdir / src.name
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


@dataclass(frozen=True)
class AttemptSpec:
    """One attempt to run: which rollout, its key, its task input, where to put its files."""

    rollout_id: str
    attempt: int
    api_key: str
    gateway_url: str
    task_input: dict[str, Any]
    workdir: Path


@dataclass(frozen=True)
class AttemptResult:
    """What happened: exit code (None if killed), whether it timed out, the output directory."""

    exit_code: int | None
    timed_out: bool
    output_dir: Path
    stdout_tail: str
    stderr_tail: str
    infra_error: str | None = None


def contract_env(
    spec: AttemptSpec, harness: HarnessSpec, task_file: Path, output_dir: Path
) -> dict[str, str]:
    """The harness contract: base URLs and the rollout's key for both APIs, task file, output dir."""
    env = {k: os.environ[k] for k in harness.passthrough if k in os.environ}
    base = spec.gateway_url.rstrip("/")
    env.update(
        {
            "HOME": str(spec.workdir),
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
    """Runs one attempt of a harness; the Controller takes any runner with this method."""

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end (exit, timeout, or failure to start)."""
        ...


def prepare_workdir(spec: AttemptSpec) -> tuple[Path, Path]:
    """Create the attempt's directory, its `output/` and `task.json`; return (output_dir, task_file)."""
    spec.workdir.mkdir(parents=True, exist_ok=True)
    output_dir = spec.workdir / "output"
    output_dir.mkdir(exist_ok=True)
    task_file = spec.workdir / "task.json"
    task_file.write_text(json.dumps(spec.task_input))
    return output_dir, task_file


OwnUid = Literal["auto", "required", "never"]


class LocalRunner:
    """Runs each attempt as a local subprocess in its own process group; as root, under a uid of its own
    (`own_uid`: "auto" where that uid can reach the harness, "required", or "never"; see isolation.py)."""

    own_uid: OwnUid = "auto"  # (also for subclasses that do not call __init__)

    def __init__(self, own_uid: OwnUid = "auto") -> None:
        self.own_uid = own_uid

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end (exit, timeout, or failure to start)."""
        output_dir, task_file = prepare_workdir(spec)
        env = contract_env(spec, harness, task_file, output_dir)
        with contextlib.ExitStack() as stack:
            try:
                uid, cwd = attempt_identity(
                    self.own_uid, spec.workdir, harness.command, env, harness.env, stack
                )
            except (IsolationError, OSError) as e:
                return AttemptResult(None, False, output_dir, "", "", infra_error=str(e))
            try:
                result = await self._spawn(spec, harness, env, cwd, preexec(uid))
            finally:  # also when cancelled: the uid's folder must be closed before the uid is freed
                note = finish_attempt(spec.workdir, uid, spec.rollout_id, spec.attempt)
        return dataclasses.replace(result, stderr_tail=result.stderr_tail + note) if note else result

    async def _spawn(self, spec: AttemptSpec, harness: HarnessSpec, env: dict[str, str], cwd: Path,
                     before_exec: Callable[[], None]) -> AttemptResult:  # fmt: skip
        output_dir = spec.workdir / "output"
        out_path, err_path = spec.workdir / "stdout.txt", spec.workdir / "stderr.txt"
        with out_path.open("wb") as out, err_path.open("wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *harness.command, cwd=cwd, env=env, stdout=out, stderr=err,
                    start_new_session=True, preexec_fn=before_exec,
                )  # fmt: skip
            except (OSError, subprocess.SubprocessError) as e:
                return AttemptResult(
                    None, False, output_dir, "", "", infra_error=f"could not start harness: {e}"
                )
            record_process(spec.workdir, proc.pid)
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout=harness.timeout_s)
            except TimeoutError:
                timed_out = True
                log.info("event=attempt_timeout rollout=%s attempt=%d", spec.rollout_id, spec.attempt)
            finally:
                kill_group(proc.pid)  # also reaps anything the harness left running
                if proc.returncode is None:
                    await proc.wait()
        return AttemptResult(
            exit_code=None if timed_out else proc.returncode,
            timed_out=timed_out,
            output_dir=output_dir,
            stdout_tail=tail(out_path, harness.max_output_bytes),
            stderr_tail=tail(err_path, harness.max_output_bytes),
        )


def preexec(uid: int | None) -> Callable[[], None]:
    """What the harness's process does between fork and exec: become `uid` (if any), then arrange to
    die with the controller (after the uid change, which would clear it)."""

    def before_exec() -> None:
        if uid is not None:
            drop_to(uid)
        die_with_parent()

    return before_exec


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
