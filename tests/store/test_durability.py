"""A gateway killed with SIGKILL mid-run: its store, reopened, holds every call whose answer was delivered."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from pathlib import Path

import httpx

from harnessrl.schema import CallStatus
from harnessrl.services import Service, free_port, start_gateway
from tests.support.store_fixtures import StoreFactory


def test_store_survives_kill_9_of_the_gateway(
    engine: Service, tmp_path: Path, store_factory: StoreFactory
) -> None:
    """On SQLite and on PostgreSQL: the gateway answers a call only once it is committed."""
    admin = "admin-" + secrets.token_hex(8)
    store_path = store_factory.spec
    gw = start_gateway(store_path, engine.url, free_port(), admin, tmp_path, default_max_tokens=4)
    gw.wait_healthy(60)
    keys = []
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {admin}"}) as c:
        for i in range(6):
            r = c.post("/control/rollouts", json={"client_id": f"k{i}", "task_id": "t"}).json()
            c.post(f"/control/rollouts/{r['rollout']['rollout_id']}/attempts").raise_for_status()
            keys.append(r["api_key"])
    delivered: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(key: str, n: int) -> None:
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as h:
            for j in range(10_000):
                if stop.is_set():
                    return
                marker = f"marker-{n}-{j}"
                body = {"model": "m", "messages": [{"role": "user", "content": marker}], "max_tokens": 4}
                try:
                    r = h.post("/v1/chat/completions", json=body)
                except httpx.HTTPError:
                    return  # the gateway is gone
                if r.status_code == 200:
                    with lock:
                        delivered.append(marker)

    threads = [threading.Thread(target=client, args=(k, n)) for n, k in enumerate(keys)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(delivered) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(gw.proc.pid, signal.SIGKILL)  # mid-run: calls are in flight
    gw.proc.wait()
    stop.set()
    for t in threads:
        t.join()
    assert len(delivered) >= 40
    store = store_factory.open()
    stored = {}
    for page_rollouts in [store.list_rollouts(limit=100)[0]]:
        for ro in page_rollouts:
            for call in store.calls(ro.rollout_id):
                stored[call.request["messages"][0]["content"]] = call
    missing = set(delivered) - set(stored)
    assert not missing, f"{len(missing)} delivered calls lost"
    for call in stored.values():  # nothing half-written
        assert call.status == CallStatus.OK and call.response is not None
        assert call.completion_ids and len(call.completion_ids) == len(call.completion_logprobs)
