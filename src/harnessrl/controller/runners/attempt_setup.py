"""The setup every local runner (plain, fork server, exec sandbox, sandboxed fork server) gives an
attempt before its harness starts, and the bookkeeping after: one copy of it.

- `attempt_env`: the attempt's folder (`prepare_workdir`: `output/`, the task file, the copied
  `harness.files`) and the harness contract's environment; inside a sandbox the gateway is reached at
  `127.0.0.1:<its port>` (the sandbox's relay), so the contract names that address.
- `run_as_attempt_uid`: for the unsandboxed runners, the uid the harness runs as (`isolation.py`), the
  guard's read-only watch, and after the attempt `finish_attempt` (kill the uid's leftovers, clean
  `output/`) with its note and the guard's findings added to the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

from harnessrl.controller.guard import ReadOnlyWatch
from harnessrl.controller.isolation import IsolationError, attempt_identity, finish_attempt
from harnessrl.controller.runner import AttemptResult, AttemptSpec, HarnessSpec, contract_env, prepare_workdir


def attempt_env(
    spec: AttemptSpec, harness: HarnessSpec, sandboxed: bool = False
) -> tuple[Path, dict[str, str]]:
    """Prepare the attempt's folder; returns its `output/` and the harness's environment (the gateway at
    `127.0.0.1:<port>` when `sandboxed`: `sandboxed_gateway` says whether that address can be given)."""
    output_dir, task_file = prepare_workdir(spec)
    if sandboxed:
        gw = urlsplit(spec.gateway_url)
        spec = dataclasses.replace(spec, gateway_url=f"http://127.0.0.1:{gw.port or 80}{gw.path}")
    return output_dir, contract_env(spec, harness, task_file, output_dir)


def sandboxed_gateway(gateway_url: str) -> tuple[str, int] | None:
    """(host, port) of a gateway a sandbox can relay to (plain http), or None."""
    gw = urlsplit(gateway_url)
    if gw.scheme != "http" or not gw.hostname:
        return None
    return gw.hostname, gw.port or 80


Body = Callable[[int | None, Path], Awaitable[AttemptResult]]


async def run_as_attempt_uid(spec: AttemptSpec, harness: HarnessSpec, own_uid: str, program: list[str],
                             env: dict[str, str], body: Body) -> AttemptResult:  # fmt: skip
    """Run `body(uid, cwd)` as the attempt of an unsandboxed runner: under the uid `own_uid` gives
    (`attempt_identity`; `program` is what that uid must reach), then `finish_attempt` (also when
    cancelled: the uid's folder must be closed before the uid is freed) and the guard's findings."""
    watch = ReadOnlyWatch(spec.guard, spec.workdir)
    with contextlib.ExitStack() as stack:
        try:
            uid, cwd = attempt_identity(own_uid, spec.workdir, program, env, harness.env, stack)
        except (IsolationError, OSError) as e:
            return AttemptResult(None, False, spec.workdir / "output", "", "", infra_error=str(e))
        try:
            result = await body(uid, cwd)
        finally:
            note = finish_attempt(spec.workdir, uid, spec.rollout_id, spec.attempt)
    return dataclasses.replace(result, stderr_tail=result.stderr_tail + note, guard_findings=watch.findings())
