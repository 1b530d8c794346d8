"""The fork-server runner: Python harnesses start as forks of a process that has already imported
them, instead of as fresh interpreters.

A harness on the `openai` SDK spends most of its start-up importing it (~0.8 CPU-s on this machine's
cores, once per attempt); with many short attempts on few cores that is CPU the engine and the trainer
do not get. `ForkServerRunner` starts one zygote (`fork_zygote.py`: stdlib only, run by path) that
imports the `preload` modules once and forks a child per attempt. The child keeps `LocalRunner`'s
contract: its own process group (killed whole at the timeout), the attempt's cwd, exactly the
contract's environment, stdout/stderr in the attempt's files, the same exit codes; it runs the harness
as `__main__` the way `python SCRIPT`, `python -m MODULE` or `python -c CODE` would.

Only commands of this interpreter (`sys.executable`) in one of those three forms are forked; any other
command (another program, interpreter options such as `-u`), and any attempt whose environment sets
`PYTHON*` variables (other than `PYTHONPATH`) the zygote was not started with, runs through
`LocalRunner`. Preloaded
modules must not read the environment when imported (the zygote's environment is not the
attempt's); the standard library and `openai` do not. A zygote that dies is started again by the next
attempt; the attempts it was running end as infrastructure errors (retried by the controller).

As root, each forked harness drops to a uid of its own before it runs (`own_uid`, as `LocalRunner`;
isolation.py): the zygote (root) forks, the child takes the attempt's uid and then runs the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harnessrl.controller.guard import plain_runner_problem
from harnessrl.controller.runner import (
    DEFAULT_PASSTHROUGH,
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    RunnerBase,
    inherited_env,
    kill_group,
    record_process,
    tail,
)
from harnessrl.controller.runners.attempt_setup import attempt_env, run_as_attempt_uid
from harnessrl.controller.runners.local import LocalRunner, OwnUid
from harnessrl.services.process import die_with_parent

if TYPE_CHECKING:
    from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).with_name("fork_zygote.py")
START_TIMEOUT_S = 120.0  # importing the preload modules
EXIT_REPORT_TIMEOUT_S = 30.0  # after a kill at the timeout, the zygote's report of the exit


class ForkServerError(RuntimeError):
    """The fork server could not start (a preload module failed to import, or it died at start)."""


def fork_form(command: Sequence[str], python: str) -> tuple[str, str, list[str]] | None:
    """(kind, target, args) when `command` can be forked from a zygote running `python`, else None."""
    if len(command) < 2 or command[0] != python:
        return None
    if command[1] in ("-m", "-c"):
        if len(command) < 3:
            return None
        return ("module" if command[1] == "-m" else "code", command[2], list(command[3:]))
    if command[1].startswith("-"):
        return None  # interpreter options the zygote was not started with
    return "path", command[1], list(command[2:])


class ForkServerRunner(RunnerBase):
    """`LocalRunner`'s contract; Python harnesses are forked from a zygote that preloaded modules."""

    def __init__(self, preload: Sequence[str] = (), python: str = sys.executable, own_uid: OwnUid = "auto") -> None:  # fmt: skip
        self.preload = tuple(preload)
        self.python = python
        self.own_uid = own_uid
        self.starts = 0  # zygotes started (more than one: one died)
        self._local = LocalRunner(own_uid)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._socket: Path | None = None
        self._lock: asyncio.Lock | None = None

    async def start(self) -> None:
        """Start the zygote now (the first attempt would); raises ForkServerError if it cannot."""
        await self._server()

    async def _server(self) -> Path:
        """The socket of a live zygote, started if there is none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._socket is not None:
                return self._socket
            self._stop()
            self._dir = Path(tempfile.mkdtemp(prefix="harnessrl-fork-"))
            self._socket = self._dir / "zygote.sock"
            self._proc = subprocess.Popen(
                [self.python, str(ZYGOTE), str(self._socket), *self.preload],
                cwd=self._dir, env=self._zygote_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
            assert self._proc.stdout is not None
            try:
                async with asyncio.timeout(START_TIMEOUT_S):
                    line = await asyncio.to_thread(self._proc.stdout.readline)
            except TimeoutError:
                line = b""
            msg = _parse(line)
            if "ready" not in msg:
                self._stop()
                why = msg.get("error") or "it exited or did not answer at start"
                raise ForkServerError(f"fork server did not start: {why}")
            self.starts += 1
            log.info("event=fork_server_ready pid=%s preload=%s", msg["ready"], ",".join(self.preload))
            return self._socket

    @staticmethod
    def _zygote_env() -> dict[str, str]:
        """The zygote's environment: what LocalRunner passes a harness of the controller's."""
        return inherited_env(DEFAULT_PASSTHROUGH)

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """As `LocalRunner`: read-only paths checked after the attempt, nothing hidden, no egress bound."""
        return plain_runner_problem(guard)

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end (exit, timeout, or failure to start)."""
        form = fork_form(harness.command, self.python)
        if form is None:
            return await self._local.run(spec, harness)
        kind, target, args = form
        _, env = attempt_env(spec, harness)
        if _interpreter_env(env) != _interpreter_env(self._zygote_env()):
            return await self._local.run(spec, harness)  # e.g. PYTHONHASHSEED: read only at start-up

        async def fork(uid: int | None, cwd: Path) -> AttemptResult:
            request = {"kind": kind, "target": target, "args": args, "cwd": str(cwd), "env": env, "uid": uid}
            return await self._forked(spec, harness, request)

        program = [self.python, *([target] if kind == "path" else [])]  # what the uid must reach
        return await run_as_attempt_uid(spec, harness, self.own_uid, program, env, fork)

    async def _forked(
        self, spec: AttemptSpec, harness: HarnessSpec, request: dict[str, Any]
    ) -> AttemptResult:
        """Have the zygote fork the harness `request` describes and wait for its exit report."""
        output_dir = spec.workdir / "output"
        out_path, err_path = spec.workdir / "stdout.txt", spec.workdir / "stderr.txt"
        out_path.write_bytes(b"")
        err_path.write_bytes(b"")
        request = {**request, "stdout": str(out_path), "stderr": str(err_path)}

        def failed(why: str) -> AttemptResult:
            return AttemptResult(None, False, output_dir, tail(out_path, harness.max_output_bytes),
                                 tail(err_path, harness.max_output_bytes), infra_error=why)  # fmt: skip

        try:
            sock = await self._server()
            reader, writer = await asyncio.open_unix_connection(str(sock))
        except (OSError, ForkServerError) as e:
            return failed(f"could not start harness: {e}")
        pid: int | None = None
        timed_out = False
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            started = _parse(await reader.readline())
            if not isinstance(started.get("pid"), int):
                return failed(f"could not start harness: fork server answered {started or 'nothing'}")
            pid = started["pid"]
            record_process(spec.workdir, pid)
            line = b""
            try:
                async with asyncio.timeout(harness.timeout_s):
                    line = await reader.readline()
            except TimeoutError:
                timed_out = True
                log.info("event=attempt_timeout rollout=%s attempt=%d", spec.rollout_id, spec.attempt)
                kill_group(pid)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EXIT_REPORT_TIMEOUT_S):
                        line = await reader.readline()
            ended = _parse(line)
            if not timed_out and not isinstance(ended.get("exit"), int):
                return failed("fork server exited before the harness did")
        except OSError as e:
            return failed(f"fork server connection failed: {e}")
        finally:
            if pid is not None:
                kill_group(pid)  # also reaps anything the harness left running
            writer.close()
        return AttemptResult(
            exit_code=None if timed_out else ended["exit"],
            timed_out=timed_out,
            output_dir=output_dir,
            stdout_tail=tail(out_path, harness.max_output_bytes),
            stderr_tail=tail(err_path, harness.max_output_bytes),
        )

    def close(self) -> None:
        """Stop the zygote (its running children die with it) and remove its socket directory."""
        self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            kill_group(self._proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._socket = None


def _interpreter_env(env: dict[str, str]) -> dict[str, str]:
    """The variables the interpreter reads only at start-up (`PYTHON*`; the child handles PYTHONPATH)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONPATH"}


def _parse(line: bytes) -> dict[str, Any]:
    """One JSON object line from the zygote; anything else (nothing, garbage): {}."""
    try:
        msg = json.loads(line)
    except ValueError:
        return {}
    return msg if isinstance(msg, dict) else {}
