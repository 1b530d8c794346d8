"""The fork server's zygote (run by path, stdlib only: `python fork_zygote.py SOCKET [MODULE...]`).

It imports the preload modules once, writes one JSON line to stdout (`{"ready": pid}`, or
`{"error": why}` and exits 2), then listens on the Unix socket SOCKET. Each connection carries one
request, a JSON line:

    {"kind": "path" | "module" | "code", "target": SCRIPT | MODULE | CODE, "args": [...],
     "cwd": DIR, "env": {...}, "stdout": FILE, "stderr": FILE, "uid": N | null}

The zygote forks, answers `{"pid": N}`, and when that child exits answers `{"exit": CODE}` (-N when
signal N ended it) and closes the connection. A request it cannot read is answered `{"error": why}`.

The child becomes the harness: a session (process group) of its own, killed when the zygote dies,
stdin from /dev/null, stdout/stderr into the given files, the attempt's cwd and exactly the given
environment (with its `PYTHONPATH` entries put on `sys.path` when they differ from the zygote's),
and, given a `uid` (the zygote runs as root), that uid and gid with no supplementary groups, after
killing whatever that uid still runs (`kill(-1)` as the uid: an earlier attempt's leftovers);
then `sys.argv` is set and `sys.path[0]` inserted, and the target runs as `__main__`, the way
`python SCRIPT ARGS`, `python -m MODULE ARGS` or `python -c CODE ARGS` would run it, and the interpreter
exits the normal way (atexit handlers, non-daemon threads joined, output flushed; an uncaught
exception prints its traceback and exits 1). Python reseeds `random` in a forked child.

The runner keeps the connection open until the exit is reported; a connection closed earlier (the
runner was cancelled or died) gets its child's process group killed, and so does a `kill` line sent on
it (the exit is then still reported). A request may carry file descriptors (SCM_RIGHTS, at most
MAX_FDS): the child finds them in the request as `fds`; the zygote closes its copies. The zygote is single-threaded
(forking a process with threads is unsafe) and handles SIGCHLD through a wakeup fd, so one loop serves
every connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

KINDS = ("path", "module", "code")
MAX_FDS = 8  # descriptors a request may carry (the sandboxed fork server's status pipe and cgroups)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def send(conn: socket.socket, msg: dict[str, Any]) -> None:
    """Write one JSON line; a connection the runner has already closed is ignored."""
    with contextlib.suppress(OSError):
        conn.setblocking(True)
        conn.sendall(json.dumps(msg).encode() + b"\n")


def check(req: Any) -> str | None:
    """Why a request cannot run (None: it can)."""
    if not isinstance(req, dict):
        return "request is not a JSON object"
    if req.get("kind") not in KINDS:
        return f"kind must be one of {KINDS}"
    for key in ("target", "cwd", "stdout", "stderr"):
        if not isinstance(req.get(key), str):
            return f"{key} must be a string"
    if not isinstance(req.get("args"), list) or not all(isinstance(a, str) for a in req["args"]):
        return "args must be a list of strings"
    uid = req.get("uid")
    if uid is not None and (not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0):
        return "uid must be a positive integer or null"
    env = req.get("env")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return "env must map strings to strings"
    return None


class Server:
    """The zygote's loop: accept connections, read requests, fork, report exits."""

    def __init__(self, path: str, checks: Callable[[Any], str | None] = check,
                 fork: Callable[[], int] = os.fork) -> None:  # fmt: skip
        self.checks = checks  # why a request cannot run (None: it can)
        self.fork = fork  # os.fork, or one that puts the child into namespaces of its own
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(256)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        self.reading: dict[socket.socket, bytes] = {}  # connections whose request is not complete yet
        self.fds: dict[socket.socket, list[int]] = {}  # descriptors sent with a request (SCM_RIGHTS)
        self.children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it

    def serve(self) -> dict[str, Any]:
        """Serve until this process is a forked child; then return the child's request."""
        sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
        sys.stdout.flush()
        while True:
            for key, _ in self.sel.select():
                conn = key.fileobj
                if key.data == "accept":
                    self.accept()
                elif key.data == "sigchld":
                    self.reap()
                elif isinstance(key.data, int):
                    assert isinstance(conn, socket.socket)
                    self.watch(conn, key.data)
                else:
                    assert isinstance(conn, socket.socket)
                    req = self.read(conn)
                    if req is not None:
                        return req

    def accept(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            conn.setblocking(False)
            self.reading[conn] = b""
            self.sel.register(conn, selectors.EVENT_READ, "request")

    def read(self, conn: socket.socket) -> dict[str, Any] | None:
        """Read from a connection that is sending its request; fork once it is complete. Returns the
        request in the child, None in the zygote."""
        try:
            chunk, fds, _, _ = socket.recv_fds(conn, 65536, MAX_FDS)
        except BlockingIOError:
            return None
        except OSError:
            chunk, fds = b"", []
        self.fds.setdefault(conn, []).extend(fds)
        if not chunk:  # closed before its request was complete
            self.sel.unregister(conn)
            del self.reading[conn]
            _close_fds(self.fds.pop(conn, []))
            conn.close()
            return None
        self.reading[conn] += chunk
        if b"\n" not in self.reading[conn]:
            return None
        line = self.reading.pop(conn).split(b"\n", 1)[0]
        fds = self.fds.pop(conn, [])
        self.sel.unregister(conn)
        why: str | None
        try:
            req = json.loads(line)
        except ValueError as e:
            req, why = None, f"request is not JSON: {e}"
        else:
            why = self.checks(req)
        if why is not None:
            send(conn, {"error": why})
            _close_fds(fds)
            conn.close()
            return None
        try:
            pid = self.fork()
        except OSError as e:  # no process left (EAGAIN), no namespace: this request fails, not the zygote
            send(conn, {"error": f"fork failed: {e}"})
            _close_fds(fds)
            conn.close()
            return None
        if pid == 0:  # the child: drop everything of the server's
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for c in [*self.reading, *self.children.values(), conn, self.listener, self.wake_r, self.wake_w]:
                c.close()
            _close_fds([fd for other in self.fds.values() for fd in other])
            self.sel.close()
            return {**req, "fds": fds}  # type: ignore[dict-item]
        _close_fds(fds)
        self.children[pid] = conn
        send(conn, {"pid": pid})
        conn.setblocking(False)
        self.sel.register(conn, selectors.EVENT_READ, pid)  # its closing means the runner is gone
        return None

    def watch(self, conn: socket.socket, pid: int) -> None:
        """The connection of a running child became readable: closed by the runner (cancelled, or
        died) — the harness has no one left to report to — or a `kill` line from it (a timeout): the
        child's process group is killed (the exit is still reported on a connection left open)."""
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(conn)
        if not data or data.startswith(b"kill"):
            for kill in (os.killpg, os.kill):  # the group; the child itself if it has no group yet
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        """Collect every child that has exited and tell its connection the exit code."""
        with contextlib.suppress(OSError):
            while self.wake_r.recv(4096):
                pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(conn)
                send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def redirect(fd: int, path: str, flags: int) -> None:
    """Point file descriptor `fd` at `path`."""
    new = os.open(path, flags, 0o644)
    if new != fd:
        os.dup2(new, fd)
        os.close(new)


def become(req: dict[str, Any]) -> None:
    """In the child: turn into the harness the request describes (session, files, cwd, environment,
    uid)."""
    os.setsid()
    die_with_parent()
    redirect(0, os.devnull, os.O_RDONLY)
    redirect(1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    redirect(2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    zygote_pythonpath = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(req["env"])
    if req.get("uid") is not None:
        try:
            drop_to(req["uid"])
        except OSError as e:
            sys.stderr.write(f"harnessrl: the fork server could not take uid {req['uid']}: {e}\n")
            os._exit(125)
        die_with_parent()  # a change of uid clears the parent-death signal
    os.chdir(req["cwd"])  # as the uid: its home is its own (a sandboxed zygote's root cannot override modes)
    pythonpath = req["env"].get("PYTHONPATH", "")
    if pythonpath != zygote_pythonpath:  # the interpreter read the zygote's at start: add the attempt's
        sys.path[0:0] = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]


def drop_to(uid: int) -> None:
    """Become `uid` (gid `uid`, no supplementary groups); kill every process that uid still runs."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    with contextlib.suppress(OSError, AttributeError):  # as after an exec: /proc shows it as the uid's
        ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # 4 = PR_SET_DUMPABLE
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)  # every process this one may signal (the uid's), itself excepted


def run_main(req: dict[str, Any]) -> None:
    """Run the request's target as `__main__`."""
    import runpy

    kind, target, args = req["kind"], req["target"], req["args"]
    if kind == "path":
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]  # run_module puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        import types

        sys.argv = ["-c", *args]
        sys.path.insert(0, "")
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def preload(names: list[str]) -> bool:
    """Import the preload modules (a failure is written to stdout as `{"error": why}`: False), then
    freeze the heap: the preloaded objects are never scanned by a child's collections (nor at exit)."""
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as e:  # any failure to import is reported, not raised
            sys.stdout.write(json.dumps({"error": f"preload {name!r}: {type(e).__name__}: {e}"}) + "\n")
            return False
    gc.freeze()
    return True


def main(argv: list[str]) -> int:
    """Preload, serve; in a child, run the harness."""
    if len(argv) < 2:
        sys.stderr.write("usage: fork_zygote.py SOCKET [MODULE...]\n")
        return 2
    die_with_parent()
    sys.path.pop(0)  # this file's directory: not a place to import the preload modules from
    if not preload(argv[2:]):
        return 2
    req = Server(argv[1]).serve()
    become(req)
    run_main(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
