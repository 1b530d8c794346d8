"""The first process inside a sandbox (run by path, stdlib only, as `python -I -S sandbox_init.py`).

It listens on 127.0.0.1:<port> in the sandbox's own network namespace, starts the harness as an
unprivileged uid with resource limits, then relays every connection to that port over the Unix
socket the host-side runner bridges to the gateway. It reports on a status pipe whether the harness
started (`ready <pid>`) or why not (`error <reason>`), so the runner can tell a sandbox failure (an
infrastructure error, retried) from the harness's own exit (a result, graded). Its exit code is the
harness's (128 + N when a signal N ended it).

It runs once per attempt, so it imports only low-level modules (`_socket`, `_thread`: `socket`,
`argparse` and `subprocess` would pull in `enum` and `re` and double its start-up time).
"""

from __future__ import annotations

import _socket
import _thread
import os
import resource
import sys

SETUP_FAILED = 125
LIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}
USAGE = (
    "usage: sandbox_init.py --status-fd N --port N --socket PATH [--uid N --gid N] [--cwd DIR]"
    " [--limit NAME=VALUE]... [--forward ADDR:PORT=SOCKET]... -- COMMAND..."
)


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(options, limits as NAME=VALUE, harness command) from `--key value ... -- command`; the
    `--forward` values (a guard's egress: ADDR:PORT=SOCKET) are in options["forward"], "\n"-joined."""
    opts: dict[str, str] = {}
    limits: list[str] = []
    i = 0
    while i < len(argv) and argv[i] != "--":
        key, value = argv[i].removeprefix("--"), argv[i + 1] if i + 1 < len(argv) else ""
        if key == "limit":
            limits.append(value)
        elif key == "forward":
            opts["forward"] = (opts["forward"] + "\n" if "forward" in opts else "") + value
        else:
            opts[key] = value
        i += 2
    command = argv[i + 1 :]
    if not command or not {"status-fd", "port", "socket"} <= opts.keys():
        raise SystemExit(USAGE)
    return opts, limits, command


def relay(src: _socket.socket, dst: _socket.socket) -> None:
    """Copy bytes from `src` to `dst` until EOF, then half-close `dst`."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(_socket.SHUT_WR)
    except OSError:
        pass


def serve(listener: _socket.socket, socket_path: str) -> None:
    """Accept connections forever; each gets a fresh connection to the gateway bridge."""
    while True:
        conn = _socket.socket(fileno=listener._accept()[0])  # type: ignore[attr-defined]
        upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            upstream.connect(socket_path)
        except OSError:
            conn.close()
            upstream.close()
            continue
        _thread.start_new_thread(relay, (conn, upstream))
        _thread.start_new_thread(relay, (upstream, conn))


def exec_harness(opts: dict[str, str], limits: list[str], command: list[str], errors: int) -> None:
    """In the forked child: drop to the attempt's uid, enter its home, set the limits, exec."""
    try:
        if "uid" in opts:
            os.setgroups([])
            os.setresgid(int(opts["gid"]), int(opts["gid"]), int(opts["gid"]))
            os.setresuid(int(opts["uid"]), int(opts["uid"]), int(opts["uid"]))
        if "cwd" in opts:
            os.chdir(opts["cwd"])
        for name, value in (s.split("=", 1) for s in limits):
            resource.setrlimit(LIMITS[name], (int(value), int(value)))
        os.execvp(command[0], command)
    except BaseException as e:
        os.write(errors, f"{type(e).__name__}: {e}".encode(errors="replace"))
    os._exit(127)


def listen(addr: str, port: int) -> _socket.socket:
    """A TCP listener on `addr:port` in the sandbox's own network namespace."""
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    listener.bind((addr, port))
    listener.listen(256)
    return listener


def main(argv: list[str]) -> int:
    """Set up the forwarders, start the harness, relay until it exits; return its exit code."""
    opts, limits, command = parse_args(argv)
    status = int(opts["status-fd"])
    relays: list[tuple[_socket.socket, str]] = []
    try:
        listener = listen("127.0.0.1", int(opts["port"]))
        relays.append((listener, opts["socket"]))
        for spec in filter(None, opts.get("forward", "").split("\n")):  # a guard's egress allowlist
            addr, _, rest = spec.partition(":")
            port, _, path = rest.partition("=")
            relays.append((listen(addr, int(port)), path))
        # Connections the harness makes before the relay thread runs wait in the listen backlog.
        err_r, err_w = os.pipe()  # close-on-exec: EOF means the exec succeeded
        pid = os.fork()
        if pid == 0:
            os.close(err_r)
            os.close(status)
            for sock, _ in relays:
                sock.close()
            exec_harness(opts, limits, command, err_w)
        os.close(err_w)
        failure = os.read(err_r, 4096).decode(errors="replace")
        os.close(err_r)
    except OSError as e:
        failure = f"{type(e).__name__}: {e}"
    if failure:
        os.write(status, f"error {failure}\n".encode())
        return SETUP_FAILED
    os.write(status, f"ready {pid}\n".encode())
    os.close(status)
    for sock, path in relays:
        _thread.start_new_thread(serve, (sock, path))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
