"""Starting the engine and gateway as child processes, each with its own log, and stopping them."""

from __future__ import annotations

import contextlib
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

from harnessrl.process import die_with_parent


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


def start_engine(
    model_dir: Path,
    port: int,
    log_dir: Path,
    max_batch: int,
    max_model_len: int | None,
    threads: int | None,
    device: str = "cpu",
    dtype: str = "float32",
    matmul: str = "auto",
) -> Service:
    """The builtin engine serving `model_dir` (`max_model_len` None: the model's own context)."""
    args = ["harnessrl.engine", "--model", str(model_dir), "--port", str(port), "--max-batch", str(max_batch)]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--device", device, "--dtype", dtype, "--matmul", matmul]
    if threads:
        args += ["--threads", str(threads)]
    return start_service("engine", args, port, log_dir)


def start_gateway(
    store_path: Path | str,
    upstream_url: str,
    port: int,
    admin_key: str,
    log_dir: Path,
    default_max_tokens: int,
    mode: str = "passthrough",
    tokenizer: Path | None = None,
    upstream_kind: str = "openai",
    name: str = "gateway",
    rollout_cache_size: int | None = None,
) -> Service:
    """The gateway over the store `store_path`: a SQLite file, or a postgresql:// URL (`name`: its
    service and log name, e.g. `gateway1` for a second replica)."""
    args = ["harnessrl.gateway", "--store", str(store_path), "--upstream", upstream_url, "--port", str(port)]
    args += [
        "--default-max-tokens",
        str(default_max_tokens),
        "--mode",
        mode,
        "--upstream-kind",
        upstream_kind,
    ]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    if rollout_cache_size is not None:
        args += ["--rollout-cache-size", str(rollout_cache_size)]
    return start_service(name, args, port, log_dir, env={"HARNESSRL_ADMIN_KEY": admin_key})
