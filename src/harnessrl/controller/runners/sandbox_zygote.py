"""The sandboxed fork server's zygote (run by path inside one long-lived bubblewrap sandbox, stdlib
only: `python sandbox_zygote.py SOCKET [MODULE...]`).

It is `fork_zygote.py`'s zygote (the same preload, socket protocol and harness start) with one more
step between the fork and the harness: each attempt gets namespaces of its own inside the sandbox.
A request carries, besides `fork_zygote`'s fields, a `sandbox` object

    {"root": DIR, "workdir": DIR, "keep": [[PATH, "ro"|"rw"]...], "hide": [PATH...],
     "unmount": [PATH...], "socket": PATH, "port": N, "tmp_bytes": N, "shm_bytes": N,
     "limits": {NAME: VALUE}}

and file descriptors: the write end of a status pipe first, then the `cgroup.procs` files of the
attempt's cgroups (opened by the runner outside). The zygote forks each attempt's first process into
a pid namespace of its own (`unshare(CLONE_NEWPID)` just before the fork, `setns` back to its own just
after), so that child (I, root, in the sandbox) is the init (pid 1) of the attempt's pid namespace. I:
- enters a mount, network, IPC and UTS namespace of its own;
- mounts a fresh `/tmp` and `/dev/shm`, unmounts `unmount` (the zygote's socket folder), covers
  `root` (the run's `rollouts/` folder, bound read-write into the sandbox) with an empty tmpfs and
  binds back only `workdir`, its own attempt's folder; the `keep` paths (the parts of the sandbox's
  view that the fresh `/tmp`, `/dev/shm` or the tmpfs over `root` cover: a checkout, its virtualenv
  or the harness under `/tmp`) are bound again as they were, parents first, read-only or read-write;
  `hide` paths (`.git`) get an empty tmpfs; mounts its namespace's own `/proc`;
- joins the attempt's cgroups (writing `0` into each `cgroup.procs`);
- brings its own loopback up and listens on 127.0.0.1:`port`;
- forks the harness (H), writes `ready PID` (or `error WHY`) on the status pipe, then relays every
  connection to that port over the gateway's Unix socket `socket` (as `sandbox_init.py` does) and
  reaps orphans until H exits; I's end takes every process of the namespace with it;
- H becomes the harness exactly as a plain fork server's child does (`fork_zygote.become`: session,
  files, cwd, environment, uid), sets the resource limits and runs it as `__main__`.
I exits with H's code (128 + N when signal N ended it, as the exec sandbox reports it).
"""

from __future__ import annotations

import _thread
import ctypes
import fcntl
import os
import resource
import socket
import struct
import sys
from typing import Any

import fork_zygote  # type: ignore[import-not-found]  # run by path: its neighbours are top-level modules
import sandbox_init  # type: ignore[import-not-found]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = sandbox_init.SETUP_FAILED
BOX_STRINGS = ("root", "workdir", "socket")
BOX_INTS = ("port", "tmp_bytes", "shm_bytes")

_libc = ctypes.CDLL(None, use_errno=True)


def check(req: Any) -> str | None:
    """Why a request cannot run (None: it can): `fork_zygote.check`, then the `sandbox` object."""
    why = fork_zygote.check(req)
    if why is not None:
        return why
    box = req.get("sandbox")
    if not isinstance(box, dict):
        return "sandbox must be an object"
    for key in BOX_STRINGS:
        if not isinstance(box.get(key), str) or not os.path.isabs(box[key]):
            return f"sandbox.{key} must be an absolute path"
    for key in BOX_INTS:
        if not isinstance(box.get(key), int) or isinstance(box[key], bool) or box[key] <= 0:
            return f"sandbox.{key} must be a positive integer"
    keep = box.get("keep")
    if not isinstance(keep, list) or not all(
        isinstance(k, list)
        and len(k) == 2
        and isinstance(k[0], str)
        and os.path.isabs(k[0])
        and k[1] in ("ro", "rw")
        for k in keep
    ):
        return 'sandbox.keep must be a list of [absolute path, "ro" or "rw"]'
    for key in ("hide", "unmount"):
        if not isinstance(box.get(key), list) or not all(isinstance(p, str) and os.path.isabs(p) for p in box[key]):  # fmt: skip
            return f"sandbox.{key} must be a list of absolute paths"
    limits = box.get("limits")
    if not isinstance(limits, dict) or not all(
        k in sandbox_init.LIMITS and isinstance(v, int) and not isinstance(v, bool) for k, v in limits.items()
    ):
        return f"sandbox.limits must map names of {sorted(sandbox_init.LIMITS)} to integers"
    if not box["workdir"].startswith(box["root"].rstrip("/") + "/"):
        return "sandbox.workdir must be under sandbox.root"
    return None


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); raises OSError naming the target."""
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _call(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def tmpfs(target: str, mode: str, size: int) -> None:
    """An empty memory-backed filesystem over `target`."""
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size}")


def enter_view(box: dict[str, Any]) -> None:
    """In I: namespaces of its own; a fresh /tmp and /dev/shm with the view's paths under them bound
    again; of the run's attempts folder only its own attempt's folder; the zygote's socket folder
    gone; `.git` paths hidden; its pid namespace's /proc."""
    _call(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the zygote or siblings
    own = os.open(box["workdir"], os.O_PATH | os.O_DIRECTORY)  # before the folder is covered
    keep = [(path, mode, os.open(path, os.O_PATH)) for path, mode in box["keep"] if os.path.lexists(path)]
    for path in box["unmount"]:
        _call(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
    tmpfs("/tmp", "1777", box["tmp_bytes"])
    tmpfs("/dev/shm", "1777", box["shm_bytes"])
    os.umask(0o022)
    for path, mode, fd in sorted(keep, key=lambda k: k[0].count("/")):  # parents first
        rebind(fd, path, read_only=mode == "ro")
    if os.path.isdir(box["root"]):  # (under /tmp it may be gone already: the fresh /tmp holds the path)
        tmpfs(box["root"], "0755", 1 << 20)
    os.makedirs(box["workdir"], mode=0o755, exist_ok=True)
    mount(f"/proc/self/fd/{own}", box["workdir"], None, MS_BIND | MS_REC)
    os.close(own)
    for path in box["hide"]:
        if os.path.isdir(path):
            tmpfs(path, "0755", 1 << 16)
        else:
            mount("/dev/null", path, None, MS_BIND)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def rebind(fd: int, path: str, read_only: bool) -> None:
    """Bind what `fd` (an O_PATH descriptor opened before a tmpfs covered it) names at `path` again,
    with what is mounted below it; `read_only` remounts it so. Closes `fd`."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.lexists(path):
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.close(fd)


def loopback_listener(port: int) -> socket.socket:
    """Bring up this network namespace's loopback; listen on 127.0.0.1:`port` (the gateway's port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(256)
    return listener


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + N when signal N ended the process."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class PidNamespaceFork:
    """The zygote's fork: each child is the init (pid 1) of a pid namespace of its own. The zygote
    unshares its children's pid namespace just before the fork and goes back to its own (`setns`)
    just after, so one process is both the attempt's init and the one that sets up its sandbox."""

    def __init__(self) -> None:
        self.own = os.open("/proc/self/ns/pid", os.O_RDONLY)  # the zygote's pid namespace

    def __call__(self) -> int:
        _call(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        try:
            pid = os.fork()
        except BaseException:
            self.back()
            raise
        if pid == 0:
            os.close(self.own)  # no way back to the sandbox's pid namespace
        else:
            self.back()
        return pid

    def back(self) -> None:
        """Into the zygote's own pid namespace again; a zygote that cannot is of no further use (its
        attempts die with it; the runner starts another)."""
        if _libc.setns(self.own, CLONE_NEWPID) != 0:
            sys.stderr.write(f"sandbox_zygote: setns: {os.strerror(ctypes.get_errno())}\n")
            os._exit(SETUP_FAILED)


def enter(req: dict[str, Any]) -> None:
    """In the zygote's child I (pid 1 of its pid namespace): set up the attempt's sandbox, fork the
    harness, relay and reap; returns only in the harness's process."""
    box, fds = req["sandbox"], req["fds"]
    if not fds:  # no status pipe: nothing to report to
        os._exit(SETUP_FAILED)
    status = fds[0]
    try:
        os.setsid()
        fork_zygote.die_with_parent()
        for fd in (0, 1, 2):
            fork_zygote.redirect(fd, os.devnull, os.O_RDWR)
        enter_view(box)
        for fd in fds[1:]:  # the attempt's cgroup.procs files: join them, children are born inside
            os.write(fd, b"0")
            os.close(fd)
        listener = loopback_listener(box["port"])
        harness = os.fork()
    except BaseException as e:
        os.write(status, f"error {type(e).__name__}: {e}\n".encode(errors="replace"))
        os._exit(SETUP_FAILED)
    if harness == 0:
        os.close(status)
        listener.close()
        become(req)
        return
    os.write(status, f"ready {harness}\n".encode())
    os.close(status)
    _thread.start_new_thread(sandbox_init.serve, (listener, box["socket"]))  # after the fork
    while True:
        pid, wait_status = os.waitpid(-1, 0)
        if pid == harness:
            os._exit(exit_code(wait_status))


def become(req: dict[str, Any]) -> None:
    """H: the harness's process, as a plain fork server's child (uid included), with the limits."""
    fork_zygote.become(req)
    for name, value in req["sandbox"]["limits"].items():
        resource.setrlimit(sandbox_init.LIMITS[name], (value, value))
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no exec can give privileges back


def main(argv: list[str]) -> int:
    """Preload, serve; in a harness's process, run the harness."""
    if len(argv) < 2:
        sys.stderr.write("usage: sandbox_zygote.py SOCKET [MODULE...]\n")
        return 2
    fork_zygote.die_with_parent()
    sys.path.pop(0)  # this file's directory: not a place to import the preload modules from
    if not fork_zygote.preload(argv[2:]):
        return 2
    req = fork_zygote.Server(argv[1], check, PidNamespaceFork()).serve()
    enter(req)
    fork_zygote.run_main(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
