"""A gateway for tests: uvicorn serving an ASGI app in a thread (`ThreadServer`), a running gateway's
URL, keys and store (`GatewayHandle`), and one rollout of an example's real harness through it."""

from __future__ import annotations

import asyncio
import json
import secrets
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn

from harnessrl.services import free_port
from harnessrl.store import SQLiteStore

if TYPE_CHECKING:
    from harnessrl.controller import RolloutOutcome
    from harnessrl.schema import Task


def loopback_tls() -> ssl.SSLContext:
    """One TLS context for every test client: httpx builds a new one (the CA bundle read again) for each
    client it creates unless given one, which cost a fuzzed route 0.05-0.2 s per example on loopback."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS


_TLS: ssl.SSLContext | None = None


class ThreadServer:
    """uvicorn serving an ASGI app in a background thread on a free loopback port."""

    def __init__(self, app: object, http: str | type[asyncio.Protocol] = "auto") -> None:
        """`http`: the HTTP protocol, uvicorn's choice by default; the `make_gateway` fixture serves
        gateways with their own (`TimedHttpProtocol`, what `python -m harnessrl.gateway` serves with)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,  # type: ignore[arg-type]
                                http=http)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class GatewayHandle:
    """A running gateway: its URL, admin key and store."""

    url: str
    admin_key: str
    store: SQLiteStore
    engine_url: str

    def admin(self) -> httpx.Client:
        """An HTTP client carrying the admin key."""
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=120,
            verify=loopback_tls(),
        )

    def new_rollout(self, client_id: str | None = None, **body: object) -> tuple[str, str]:
        """Create a rollout (and start its attempt); returns (rollout_id, api_key)."""
        with self.admin() as c:
            r = c.post(
                "/control/rollouts",
                json={"client_id": client_id or secrets.token_hex(4), "task_id": "t", **body},
            )
            r.raise_for_status()
            rid = r.json()["rollout"]["rollout_id"]
            c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
            return rid, r.json()["api_key"]


async def run_example_episode(
    example_name: str, gw: GatewayHandle, task: Task, client_id: str, run_dir: Path
) -> tuple[RolloutOutcome, dict[str, Any]]:
    """One rollout of an example's real harness (a subprocess) through `gw`: its outcome and the
    `answer.json` the harness wrote."""
    from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
    from harnessrl.examples import get_example
    from harnessrl.gateway.client import ControlClient

    example = get_example(example_name)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec(command=example.harness_command, timeout_s=120),
                     example.grader, run_dir, concurrency=1)  # fmt: skip
    try:
        (outcome,) = await ctl.run([RolloutRequest(task=task, client_id=client_id)])
    finally:
        await client.aclose()
    answer_file = run_dir / "rollouts" / outcome.rollout_id / "attempt-0" / "output" / "answer.json"
    answer = json.loads(answer_file.read_text()) if answer_file.exists() else {}
    return outcome, answer
