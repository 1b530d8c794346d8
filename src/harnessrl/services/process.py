"""Child processes: what a child does to itself before exec (shared with the controller's runners), a
service (an HTTP server in a child process with its own log), starting and stopping one."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


def die_with_parent() -> None:
    """In a child before exec: SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG), so a run or a
    controller killed with -9 leaves no engine, gateway or harness running unowned."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """A child process serving HTTP at `url`."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    group: bool = False  # the process leads its own process group; `stop` ends the whole group

    def wait_healthy(self, timeout_s: float = 300.0, progress: Callable[[float], None] | None = None) -> None:
        """Block until `GET /health` answers 200; raise with the log's tail if the process dies.
        `progress`, if given, is called with the seconds waited so far about every 10 s."""
        start = time.monotonic()
        deadline = start + timeout_s
        told = start
        while time.monotonic() < deadline:
            if progress is not None and time.monotonic() - told >= 10.0:
                told = time.monotonic()
                progress(told - start)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        """The last lines of the service's log."""
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (to the whole process group with `group`: a server
        whose own children outlive it when it is killed, as vLLM's engine core does)."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        if self.group:  # what is left of the group once the leader is gone (it was killed, or crashed)
            deadline = time.monotonic() + timeout_s
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        if self.group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_service(
    name: str,
    args: list[str],
    port: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    python: str | None = None,
    group: bool = False,
) -> Service:
    """Start `python -m <args...>` (this interpreter unless `python` names another, e.g. vLLM's venv)
    with its output in `<log_dir>/<name>.log`; `group`: in a process group of its own, which `stop` ends."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    # a fatal error (segfault, abort) prints the Python stacks into the service's log
    full_env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [python or sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
            preexec_fn=die_with_parent, start_new_session=group,
        )  # fmt: skip
    return Service(name=name, proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path, group=group)
