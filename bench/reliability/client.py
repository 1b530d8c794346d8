"""What the fault suite needs to drive a gateway from outside: a lean keep-alive HTTP/1.1 client (a
general client's overhead would make the load generator, not the gateway, the bottleneck on two
cores), and the gateway and fault engine as subprocesses on loopback."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


class Closed(Exception):
    """The server closed the connection before a whole answer."""


class RawClient:
    """One keep-alive connection to `127.0.0.1:port`; `request` returns (status, whole body)."""

    def __init__(self, port: int, headers: dict[str, str]) -> None:
        self.port = port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", timeout_s: float = 60.0
    ) -> tuple[int, bytes]:
        """Send one request and read its answer (Content-Length or chunked)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=2**24)
        assert self.reader is not None
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n").encode()  # fmt: skip
        self.writer.write(head + self.extra + b"\r\n" + body)
        try:
            return await asyncio.wait_for(self._answer(self.reader), timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self.close()
            raise Closed(str(e)) from e
        except BaseException:
            self.close()
            raise

    @staticmethod
    async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return status, bytes(body)
                body += await reader.readexactly(size + 2)
                del body[-2:]
        return status, await reader.readexactly(int(headers.get("content-length", "0")))

    def close(self) -> None:
        """Drop the connection."""
        if self.writer is not None:
            self.writer.close()
        self.writer = None


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


@dataclass
class Proc:
    """A subprocess serving on `port`, its output in `log`."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Terminate (then kill) the process."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(args: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Proc:
    """Start `python args...` with its output in `log`."""
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})  # fmt: skip
    return Proc(proc, port, log)


def start_engine(work: Path, fault: str = "ok", tokens: int = 40, prompt_tokens: int = 300) -> Proc:
    """The fault engine (`fault_engine.py`) on a free port; answers the size of `bench/stub_upstream`'s."""
    port = free_port()
    args = [
        str(HERE / "fault_engine.py"),
        str(port),
        fault,
        "--tokens",
        str(tokens),
        "--prompt-tokens",
        str(prompt_tokens),
    ]
    p = spawn(args, port, work / f"engine-{port}.log")
    wait_http(f"{p.url}/health")
    return p


@dataclass
class Gateway:
    """A gateway subprocess, its admin key and store file."""

    proc: Proc
    admin: str
    store: Path

    def new_rollouts(self, n: int, prefix: str = "r") -> list[tuple[str, str]]:
        """Create `n` running rollouts; (rollout_id, key) each."""
        out = []
        with httpx.Client(
            base_url=self.proc.url, headers={"Authorization": f"Bearer {self.admin}"}, timeout=30
        ) as c:
            for i in range(n):
                r = c.post(
                    "/control/rollouts",
                    json={"client_id": f"{prefix}{i}-{secrets.token_hex(3)}", "task_id": "t"},
                )
                r.raise_for_status()
                rid = r.json()["rollout"]["rollout_id"]
                c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
                out.append((rid, r.json()["api_key"]))
        return out


def start_gateway(
    work: Path, engine_url: str, flags: list[str] | None = None, pythonpath: str | None = None
) -> Gateway:
    """`python -m harnessrl.gateway` over a fresh store in `work` (`pythonpath`: another checkout's src)."""
    port, admin = free_port(), "admin-" + secrets.token_hex(8)
    store = work / f"store-{port}.sqlite"
    args = [
        "-m",
        "harnessrl.gateway",
        "--store",
        str(store),
        "--upstream",
        engine_url,
        "--port",
        str(port),
        *(flags or []),
    ]
    env = {"HARNESSRL_ADMIN_KEY": admin, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    p = spawn(args, port, work / f"gateway-{port}.log", env)
    wait_http(f"{p.url}/health")
    return Gateway(p, admin, store)
