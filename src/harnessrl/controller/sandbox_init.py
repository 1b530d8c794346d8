"""The first process inside a sandbox (run by path, stdlib only, as `python -I -S sandbox_init.py`).

It listens on 127.0.0.1:<port> in the sandbox's own network namespace, starts the harness as an
unprivileged uid with resource limits, then relays every connection to that port over the Unix
socket the host-side runner bridges to the gateway. It reports on a status pipe whether the harness
started (`{"ready": true}`) or why not (`{"error": ...}`), so the runner can tell a sandbox failure
(an infrastructure error, retried) from the harness's own exit (a result, graded). Its exit code is
the harness's (128 + N when a signal N ended it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

SETUP_FAILED = 125
LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The launcher's arguments; everything after `--` is the harness command."""
    p = argparse.ArgumentParser(prog="sandbox_init")
    p.add_argument("--status-fd", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--socket", required=True, help="Unix socket bridged to the gateway")
    p.add_argument("--uid", type=int, default=None)
    p.add_argument("--gid", type=int, default=None)
    p.add_argument("--cwd", default=None)
    p.add_argument("--limit", action="append", default=[], help="name=value, name in " + ",".join(LIMITS))
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no harness command")
    return args


def pre_exec(specs: list[str], cwd: str | None) -> Callable[[], None]:
    """What the harness's process does after dropping to its uid: enter `cwd` (only reachable as
    that uid) and set the hard and soft limits named in `specs` (`name=value`)."""
    pairs = [(LIMITS[name], int(value)) for name, value in (s.split("=", 1) for s in specs)]

    def apply() -> None:
        try:
            if cwd is not None:
                os.chdir(cwd)
            for which, value in pairs:
                resource.setrlimit(which, (value, value))
        except Exception as e:  # Popen reports only "Exception occurred in preexec_fn"
            os.write(2, f"sandbox_init: {e!r}\n".encode())
            raise

    return apply


def relay(src: socket.socket, dst: socket.socket) -> None:
    """Copy bytes from `src` to `dst` until EOF, then half-close `dst`."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def serve(listener: socket.socket, socket_path: str) -> None:
    """Accept connections forever; each gets a fresh connection to the gateway bridge."""
    while True:
        conn, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(socket_path)
        except OSError:
            conn.close()
            upstream.close()
            continue
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=relay, args=(a, b), daemon=True).start()


def main(argv: list[str]) -> int:
    """Set up the forwarder, start the harness, relay until it exits; return its exit code."""
    args = parse_args(argv)
    status = os.fdopen(args.status_fd, "w")
    try:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", args.port))
        listener.listen(256)
        # The harness starts while this process is still single-threaded (pre-exec is then safe);
        # its connections wait in the listen backlog until the relay thread below accepts them.
        proc = subprocess.Popen(
            args.command,
            user=args.uid,
            group=args.gid,
            extra_groups=[] if args.uid is not None else None,
            preexec_fn=pre_exec(args.limit, args.cwd),
        )
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        status.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        status.close()
        return SETUP_FAILED
    status.write(json.dumps({"ready": True, "pid": proc.pid}) + "\n")
    status.close()
    threading.Thread(target=serve, args=(listener, args.socket), daemon=True).start()
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
