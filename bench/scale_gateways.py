"""Replicated gateways under load (part of `make bench-scale`; `python -m bench.scale_gateways` alone).

- `rps_by_replicas`: model calls per second through 1 gateway on SQLite, 1 on PostgreSQL and 2 replicas
  on the same PostgreSQL database, same stub engine (`bench/reliability/fault_engine.py`, ~5 KB vLLM-like
  answers), same load: `concurrency` rollouts sending non-streamed chat calls back to back for
  `seconds`, each rollout on the replica `GatewayReplicas` picks for it. Latency is the client's (p50,
  p99); the load generator shares the machine's cores with the gateways.
- `replica_kill`: 2 replicas on PostgreSQL under that load; replica 0 gets `kill -9` mid-load. A client
  whose call dies asks `GatewayReplicas.lost` and carries on with the rollout's new replica
  (`model_url`). `replica_kill_lost_calls` = answers delivered to a client whose call is not complete in
  the database (must be 0); `recover_s` = from the kill to each moved rollout's first answer from its
  new replica (max and median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.reliability.client import Closed, RawClient, start_engine
from bench.reliability.load import body, delivered

from harnessrl.gateway.replicas import GatewayReplicas
from harnessrl.schema import RolloutCreate
from harnessrl.services import Service, free_port, start_gateway


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Load:
    """`concurrency` rollouts calling back to back through `GatewayReplicas`; what was delivered."""

    def __init__(self, client: GatewayReplicas, concurrency: int) -> None:
        self.client = client
        self.concurrency = concurrency
        self.delivered: list[str] = []
        self.latencies: list[float] = []
        self.cut = 0
        self.failed = 0
        self.moved_at: dict[str, float] = {}  # rollout -> when its first answer after a move came
        self.stop = asyncio.Event()

    async def setup(self, tag: str) -> list[tuple[str, str]]:
        out = []
        for i in range(self.concurrency):
            c = await self.client.create_rollout(RolloutCreate(client_id=f"{tag}-{i}-{secrets.token_hex(3)}",
                                                               task_id="t"))  # fmt: skip
            rid = c.rollout.rollout_id
            await self.client.start_attempt(rid)
            out.append((rid, c.api_key))
        return out

    async def _one(self, n: int, rid: str, key: str) -> None:
        url = self.client.model_url(rid)
        raw = RawClient(int(url.rsplit(":", 1)[1]), {"Authorization": f"Bearer {key}"})
        j, moved = 0, False
        while not self.stop.is_set():
            marker = f"marker-{n}-{j}"
            j += 1
            t0 = time.perf_counter()
            try:
                status, data = await raw.request("POST", "/v1/chat/completions", body(marker, False), 30.0)
            except (Closed, OSError, TimeoutError):
                self.cut += 1
                raw.close()
                if await self.client.lost(url):  # its replica is gone: carry on with the new one
                    url = self.client.model_url(rid)
                    raw = RawClient(int(url.rsplit(":", 1)[1]), {"Authorization": f"Bearer {key}"})
                    moved = True
                await asyncio.sleep(0.01)
                continue
            if delivered(status, data, False):
                self.delivered.append(marker)
                self.latencies.append(time.perf_counter() - t0)
                if moved and rid not in self.moved_at:
                    self.moved_at[rid] = time.monotonic()
            else:
                self.failed += 1
        raw.close()

    async def run(self, rollouts: list[tuple[str, str]], seconds: float) -> float:
        tasks = [asyncio.create_task(self._one(n, rid, key)) for n, (rid, key) in enumerate(rollouts)]
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        self.stop.set()
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0


def _gateways(store: str, engine_url: str, n: int, admin: str, logs: Path) -> list[Service]:
    gws = [
        start_gateway(store, engine_url, free_port(), admin, logs, 40, name=f"gateway{i}") for i in range(n)
    ]
    for g in gws:
        g.wait_healthy(60)
    return gws


async def throughput(store: str, engine_url: str, n: int, concurrency: int, seconds: float,
                     logs: Path) -> dict[str, Any]:  # fmt: skip
    """Calls per second through `n` gateways on `store`."""
    admin = secrets.token_hex(16)
    gws = _gateways(store, engine_url, n, admin, logs)
    client = GatewayReplicas([g.url for g in gws], admin)
    try:
        load = Load(client, concurrency)
        rollouts = await load.setup(f"rps{n}")
        await Load(client, concurrency).run(rollouts, 1.0)  # warm-up: connections, caches, JIT of the stub
        wall = await load.run(rollouts, seconds)
    finally:
        await client.aclose()
        for g in gws:
            g.stop()
    return {"replicas": n, "calls": len(load.delivered), "rps": len(load.delivered) / wall,
            "latency_ms_p50": 1000 * _percentile(load.latencies, 0.5),
            "latency_ms_p99": 1000 * _percentile(load.latencies, 0.99), "failed": load.failed, "cut": load.cut}  # fmt: skip


def stored_complete(pg_url: str) -> set[str]:
    """Markers of the calls stored complete (ok, with tokens and logprobs) in the database."""
    import psycopg

    markers = set()
    with psycopg.connect(pg_url) as conn:
        for (raw,) in conn.execute("SELECT body FROM calls"):
            call = json.loads(raw)
            if (
                call["status"] == "ok"
                and call["response"]
                and call["completion_ids"]
                and (len(call["completion_ids"]) == len(call["completion_logprobs"]))
            ):
                markers.add(call["request"]["messages"][1]["content"])
    return markers


async def replica_kill(
    pg_url: str, engine_url: str, concurrency: int, seconds: float, logs: Path
) -> dict[str, Any]:
    """Two replicas under load; replica 0 killed halfway; delivered answers against the database."""
    admin = secrets.token_hex(16)
    gws = _gateways(pg_url, engine_url, 2, admin, logs)
    client = GatewayReplicas([g.url for g in gws], admin, retry_down_s=30.0)
    try:
        load = Load(client, concurrency)
        rollouts = await load.setup("kill")
        on_0 = [rid for rid, _ in rollouts if client.model_url(rid) == gws[0].url]
        task = asyncio.create_task(load.run(rollouts, seconds))
        await asyncio.sleep(seconds / 2)
        killed_at = time.monotonic()
        os.kill(gws[0].proc.pid, signal.SIGKILL)  # calls are in flight on it
        await task
        gws[0].proc.wait()
    finally:
        await client.aclose()
        for g in gws:
            g.stop()
    stored = stored_complete(pg_url)
    lost = sorted(set(load.delivered) - stored)
    recover = [t - killed_at for t in load.moved_at.values()]
    return {"rollouts": concurrency, "rollouts_on_killed_replica": len(on_0), "rollouts_moved": len(load.moved_at),
            "delivered": len(load.delivered), "stored_complete": len(stored), "replica_kill_lost_calls": len(lost),
            "lost_examples": lost[:5], "cut_calls": load.cut, "failed_answers": load.failed,
            "recover_s_max": max(recover) if recover else None,
            "recover_s_median": statistics.median(recover) if recover else None, "failovers": client.failovers}  # fmt: skip


async def bench_gateways(
    concurrency: int = 16, seconds: float = 10.0, kill_seconds: float = 10.0
) -> dict[str, Any]:
    """Throughput by replica count and the replica kill, on a PostgreSQL server started here."""
    from harnessrl.store.pg_local import LocalPostgres

    pg = LocalPostgres().start()
    work = Path(tempfile.mkdtemp(prefix="harnessrl-scale-gw-"))
    engine = start_engine(work)
    try:
        sqlite = await throughput(
            str(work / "store.sqlite"), engine.url, 1, concurrency, seconds, work / "logs"
        )
        pg1 = await throughput(pg.create_database(), engine.url, 1, concurrency, seconds, work / "logs")
        pg2 = await throughput(pg.create_database(), engine.url, 2, concurrency, seconds, work / "logs")
        kill = await replica_kill(pg.create_database(), engine.url, concurrency, kill_seconds, work / "logs")
    finally:
        engine.stop()
        pg.stop()
    return {
        "concurrency": concurrency, "seconds": seconds, "engine": "bench/reliability/fault_engine.py (stub, ~5 KB)",
        "rps_by_replicas": {"sqlite_1": sqlite["rps"], "postgres_1": pg1["rps"], "postgres_2": pg2["rps"]},
        "runs": {"sqlite_1": sqlite, "postgres_1": pg1, "postgres_2": pg2},
        "replica_kill": kill, "replica_kill_lost_calls": kill["replica_kill_lost_calls"],
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--kill-seconds", type=float, default=10.0)
    args = p.parse_args()
    out = asyncio.run(bench_gateways(args.concurrency, args.seconds, args.kill_seconds))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
