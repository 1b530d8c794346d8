"""The local runner: one subprocess per attempt, the harness contract in its environment, a timeout
that kills the whole process group; as root, the harness runs under a uid of its own (`isolation.py`),
and after every attempt `output/` is cleaned of links the grader must not follow. A task's guard is
checked, not enforced: read-only paths are hashed before and after (`controller/guard.py`), and a guard
asking to hide paths or bound the network is refused (`guard_problem`)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from harnessrl.controller.guard import plain_runner_problem
from harnessrl.controller.isolation import drop_to
from harnessrl.controller.runner import (
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    RunnerBase,
    kill_group,
    record_process,
    tail,
)
from harnessrl.controller.runners.attempt_setup import attempt_env, run_as_attempt_uid
from harnessrl.services.process import die_with_parent

if TYPE_CHECKING:
    from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

OwnUid = Literal["auto", "required", "never"]


class LocalRunner(RunnerBase):
    """Runs each attempt as a local subprocess in its own process group; as root, under a uid of its own
    (`own_uid`: "auto" where that uid can reach the harness, "required", or "never"; see isolation.py)."""

    own_uid: OwnUid = "auto"  # (also for subclasses that do not call __init__)

    def __init__(self, own_uid: OwnUid = "auto") -> None:
        self.own_uid = own_uid

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """Read-only paths are checked after the attempt; hidden paths and egress cannot be enforced."""
        return plain_runner_problem(guard)

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end (exit, timeout, or failure to start)."""
        _, env = attempt_env(spec, harness)

        async def spawn(uid: int | None, cwd: Path) -> AttemptResult:
            return await self._spawn(spec, harness, env, cwd, preexec(uid))

        return await run_as_attempt_uid(spec, harness, self.own_uid, harness.command, env, spawn)

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
                async with asyncio.timeout(harness.timeout_s):
                    await proc.wait()
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
