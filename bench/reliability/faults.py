"""The engine's faults as a harness sees them through the gateway: for each fault, streamed and not,
what the client got (status, an error event), how long it took, and what the store recorded. And how
long a 100k-message request holds the gateway's event loop (the latency of /health meanwhile)."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from bench.reliability.client import Gateway, RawClient, start_engine, start_gateway

FAULTS = ("500", "hang", "nonjson", "close", "badevent")
# Short limits, so a hung engine costs seconds here (defaults: 30 s, 600 s, 600 s).
FLAGS = ["--stream-open-timeout", "1", "--upstream-timeout", "2", "--call-timeout", "6"]


def last_call(store: Path, rid: str) -> dict[str, Any] | None:
    """The rollout's last recorded call (status, error, finish reason, tokens), read from the file."""
    db = sqlite3.connect(store)
    try:
        row = db.execute(
            "SELECT body FROM calls WHERE rollout_id = ? ORDER BY idx DESC LIMIT 1", (rid,)
        ).fetchone()
    finally:
        db.close()
    if row is None:
        return None
    call = json.loads(row[0])
    return {"status": call["status"], "error": (call.get("error") or "")[:160], "finish_reason": call.get("finish_reason"),
            "completion_tokens": len(call["completion_ids"])}  # fmt: skip


async def one_call(gw: Gateway, key: str, content: str, stream: bool) -> dict[str, Any]:
    """A chat call; the client's view of its outcome."""
    client = RawClient(gw.proc.port, {"Authorization": f"Bearer {key}"})
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}
    ).encode()
    t0 = time.monotonic()
    try:
        status, data = await client.request("POST", "/v1/chat/completions", body, timeout_s=120)
        outcome: dict[str, Any] = {"http_status": status}
        if stream and status == 200:
            outcome["error_event"] = b'"error"' in data
            outcome["done"] = data.rstrip().endswith(b"[DONE]")
    except Exception as e:
        outcome = {"http_status": None, "client_error": type(e).__name__}
    finally:
        client.close()
    outcome["seconds"] = round(time.monotonic() - t0, 2)
    return outcome


async def engine_faults(work: Path) -> dict[str, Any]:
    """Each injected fault, then the engine killed (before a call, and in the middle of a stream)."""
    engine = start_engine(work, tokens=8)
    gw = start_gateway(work, engine.url, FLAGS)
    results: dict[str, Any] = {}
    try:
        rollouts = gw.new_rollouts(2 * len(FAULTS) + 3, prefix="fault")
        for i, fault in enumerate(FAULTS):
            for j, stream in enumerate((False, True)):
                rid, key = rollouts[2 * i + j]
                outcome = await one_call(gw, key, f"fault:{fault}", stream)
                outcome["recorded"] = last_call(gw.store, rid)
                results[f"{fault}/{'stream' if stream else 'whole'}"] = outcome
        rid, key = rollouts[-3]  # killed in the middle of a slow stream
        task = asyncio.create_task(one_call(gw, key, "fault:slow", True))
        await asyncio.sleep(1.0)
        engine.proc.send_signal(signal.SIGKILL)
        results["killed/mid_stream"] = {**await task, "recorded": last_call(gw.store, rid)}
        for rid, key, stream in (
            (*rollouts[-2], False),
            (*rollouts[-1], True),
        ):  # engine gone before the call
            outcome = await one_call(gw, key, "hi", stream)
            results[f"killed/{'stream' if stream else 'whole'}"] = {
                **outcome,
                "recorded": last_call(gw.store, rid),
            }
    finally:
        gw.proc.stop()
        engine.stop()
    clear = sum(1 for r in results.values() if _clear_failure(r))
    return {"flags": FLAGS, "cases": results, "clear_failures": clear, "total": len(results)}


def _clear_failure(r: dict[str, Any]) -> bool:
    """The harness was told (502, or an error event) and a failed call was recorded."""
    told = r.get("http_status") == 502 or r.get("error_event") is True
    return told and (r.get("recorded") or {}).get("status") == "failed"


async def loop_stall(work: Path, pythonpath: str | None = None, n_messages: int = 100_000) -> dict[str, Any]:
    """The slowest /health answer while one request with `n_messages` messages is handled."""
    engine = start_engine(work)
    gw = start_gateway(work, engine.url, pythonpath=pythonpath)
    try:
        (_, key), = gw.new_rollouts(1, prefix="stall")  # fmt: skip
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(n_messages)
        ]
        body = json.dumps({"model": "m", "messages": messages}).encode()
        probe = RawClient(gw.proc.port, {})
        latencies: list[float] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                t0 = time.monotonic()
                await probe.request("GET", "/health")
                latencies.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.5)
        baseline = max(latencies) if latencies else 0.0
        big = RawClient(gw.proc.port, {"Authorization": f"Bearer {key}"})
        t0 = time.monotonic()
        status, _ = await big.request("POST", "/v1/chat/completions", body, timeout_s=120)
        seconds = time.monotonic() - t0
        await asyncio.sleep(0.2)
        done.set()
        await watcher
        big.close()
        probe.close()
    finally:
        gw.proc.stop()
        engine.stop()
    return {"messages": n_messages, "body_mb": round(len(body) / 2**20, 1), "status": status,
            "request_seconds": round(seconds, 2), "health_max_ms_idle": round(baseline * 1e3, 1),
            "health_max_ms_during": round(max(latencies) * 1e3, 1)}  # fmt: skip


def metrics_need_key(gw_url: str, admin: str) -> dict[str, int]:
    """/metrics without a key, and with the admin key."""
    return {"no_key": httpx.get(f"{gw_url}/metrics").status_code,
            "admin_key": httpx.get(f"{gw_url}/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code}  # fmt: skip
