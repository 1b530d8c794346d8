"""Steady load on a gateway from `concurrency` rollouts: what was delivered, and what the store held
after a `kill -9`; the WAL's size under a minute of it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from bench.reliability.client import Closed, Gateway, RawClient, start_engine, start_gateway

PAD = "lorem ipsum " * 200  # ~2.4 KB of context per call, so a call weighs what a harness's does


def body(marker: str, stream: bool) -> bytes:
    """A chat call whose first message carries `marker` (how the store is searched afterwards)."""
    messages = [{"role": "system", "content": PAD}, {"role": "user", "content": marker}]
    return json.dumps({"model": "m", "messages": messages, "stream": stream}).encode()


def delivered(status: int, data: bytes, stream: bool) -> bool:
    """The harness got a whole answer: 200 and, streamed, the closing `[DONE]` with no error event."""
    if status != 200:
        return False
    if not stream:
        return b'"choices"' in data
    return data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data


async def drive(
    gw: Gateway, keys: list[str], stream: bool, stop: asyncio.Event, out: list[str]
) -> dict[str, int]:
    """Each key sends calls back to back until `stop`; delivered markers go to `out`."""
    counts = {"sent": 0, "delivered": 0, "failed": 0, "cut": 0}

    async def one(n: int, key: str) -> None:
        client = RawClient(gw.proc.port, {"Authorization": f"Bearer {key}"})
        j = 0
        while not stop.is_set():
            marker = f"marker-{n}-{j}"
            j += 1
            counts["sent"] += 1
            try:
                status, data = await client.request("POST", "/v1/chat/completions", body(marker, stream))
            except (Closed, OSError, TimeoutError):
                counts["cut"] += 1
                await asyncio.sleep(0.05)
                continue
            if delivered(status, data, stream):
                counts["delivered"] += 1
                out.append(marker)
            else:
                counts["failed"] += 1
        client.close()

    await asyncio.gather(*[one(n, k) for n, k in enumerate(keys)])
    return counts


def stored_markers(store: Path) -> tuple[set[str], bool, int]:
    """Markers of the complete calls in `store`, its integrity, and how many rows are incomplete."""
    db = sqlite3.connect(store)
    try:
        ok = db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        markers, incomplete = set(), 0
        for (raw,) in db.execute("SELECT body FROM calls"):
            call = json.loads(raw)
            complete = (
                call["status"] == "ok"
                and call["response"]
                and len(call["completion_ids"]) == len(call["completion_logprobs"]) > 0
            )
            if complete:
                markers.add(call["request"]["messages"][1]["content"])
            else:
                incomplete += 1
        return markers, ok, incomplete
    finally:
        db.close()


async def kill_run(work: Path, stream: bool, concurrency: int, seconds: float) -> dict[str, Any]:
    """Load for `seconds`, then SIGKILL the gateway mid-load; compare delivered with stored."""
    engine = start_engine(work)
    gw = start_gateway(work, engine.url)
    try:
        keys = [k for _, k in gw.new_rollouts(concurrency)]
        stop, out = asyncio.Event(), []
        task = asyncio.create_task(drive(gw, keys, stream, stop, out))
        await asyncio.sleep(seconds)
        os.kill(gw.proc.proc.pid, signal.SIGKILL)  # calls are in flight
        await asyncio.sleep(0.5)
        stop.set()
        counts = await task
        gw.proc.proc.wait()
    finally:
        gw.proc.stop()
        engine.stop()
    markers, integrity, incomplete = stored_markers(gw.store)
    lost = sorted(set(out) - markers)
    return {"stream": stream, "delivered": len(out), "stored_complete": len(markers), "lost": len(lost),
            "lost_examples": lost[:5], "incomplete_rows": incomplete, "integrity_ok": integrity, **counts}  # fmt: skip


class WalSampler(threading.Thread):
    """Samples the size of `<store>-wal` every `every_s` until stopped."""

    def __init__(self, store: Path, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.wal = Path(f"{store}-wal")
        self.every_s = every_s
        self.max_bytes = 0
        self.halt = threading.Event()

    def run(self) -> None:
        """Sample until `halt`."""
        while not self.halt.wait(self.every_s):
            try:
                self.max_bytes = max(self.max_bytes, self.wal.stat().st_size)
            except FileNotFoundError:
                pass


async def wal_run(
    work: Path, concurrency: int, seconds: float, pythonpath: str | None = None
) -> dict[str, Any]:
    """`seconds` of non-streamed load at `concurrency`; the WAL's largest size and the database's."""
    engine = start_engine(work)
    gw = start_gateway(work, engine.url, pythonpath=pythonpath)
    sampler = WalSampler(gw.store)
    sampler.start()
    try:
        keys = [k for _, k in gw.new_rollouts(concurrency)]
        stop, out = asyncio.Event(), []
        task = asyncio.create_task(drive(gw, keys, False, stop, out))
        await asyncio.sleep(seconds)
        stop.set()
        counts = await task
        db_mb = gw.store.stat().st_size / 2**20
        wal_at_end = Path(f"{gw.store}-wal")
        wal_end_mb = wal_at_end.stat().st_size / 2**20 if wal_at_end.exists() else 0.0
        gw.proc.proc.send_signal(signal.SIGTERM)
        gw.proc.proc.wait(60)
        wal_after = wal_at_end.stat().st_size / 2**20 if wal_at_end.exists() else 0.0
    finally:
        sampler.halt.set()
        gw.proc.stop()
        engine.stop()
    return {"seconds": seconds, "concurrency": concurrency, "calls": counts["delivered"],
            "calls_per_s": round(counts["delivered"] / seconds, 1), "wal_max_mb": round(sampler.max_bytes / 2**20, 1),
            "wal_end_of_load_mb": round(wal_end_mb, 1), "db_mb": round(db_mb, 1),
            "wal_after_sigterm_mb": round(wal_after, 1)}  # fmt: skip


def time_left(deadline: float) -> float:
    """Seconds until `deadline` (a `time.monotonic()` instant)."""
    return max(0.0, deadline - time.monotonic())
