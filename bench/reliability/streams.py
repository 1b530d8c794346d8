"""Load held by one gateway process: thousands of streaming calls open at once against a slow engine,
then tens of thousands of rollouts registered and served.

1. `--streams` rollouts each open one streaming chat call against the fault engine's `slow` answers
   (`--stream-seconds` long: a token every second), all at once. Once every stream has its headers, the
   gateway's RSS is sampled; then every stream is read to its end. `open_streams_held` counts streams
   that reached `[DONE]`, `errors_under_open_streams` everything else (a status other than 200, a stream
   cut short, a connection refused), `rss_mb_per_open_stream` = (RSS with all open - RSS before) / held.
2. `--rollouts` rollouts are registered, and each makes one non-streamed call (`--concurrency` at once);
   `rollouts_served` counts 200 answers, `errors_serving_rollouts` the rest.

The gateway raises its own open-file limit at start; this process and the engine raise theirs.

    python -m bench.reliability.streams --streams 5000 --stream-seconds 30 --rollouts 20000 --out FILE

Merges its rows into FILE (bench/results/reliability.json by default) under "load_held".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from bench.reliability.client import Gateway, free_port, spawn, start_gateway, wait_http

HERE = Path(__file__).resolve().parent
CHAT = "/v1/chat/completions"


def raise_nofile() -> int:
    """This process's open-file limit raised to its hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def slow_engine(work: Path, seconds: int) -> str:
    """The fault engine answering every request slowly: `seconds` tokens, one a second."""
    port = free_port()
    args = [
        str(HERE / "fault_engine.py"),
        str(port),
        "slow",
        "--slow-tokens",
        str(seconds),
        "--slow-interval",
        "1",
    ]
    p = spawn(args, port, work / "engine.log")
    wait_http(f"{p.url}/health")
    return p.url


def register(gw: Gateway, n: int) -> list[str]:
    """`n` running rollouts; their keys."""
    keys = []
    with httpx.Client(base_url=gw.proc.url, headers={"Authorization": f"Bearer {gw.admin}"}, timeout=60) as c:
        for i in range(n):
            r = c.post(
                "/control/rollouts", json={"client_id": f"load-{i}-{secrets.token_hex(3)}", "task_id": "t"}
            )
            r.raise_for_status()
            rid = r.json()["rollout"]["rollout_id"]
            c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
            keys.append(r.json()["api_key"])
    return keys


def _request(key: str, stream: bool, fault: str) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "max_tokens": 64,
                       "messages": [{"role": "user", "content": f"hi fault:{fault}"}]}).encode()  # fmt: skip
    return (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


async def one_stream(port: int, key: str, opened: asyncio.Event, counter: list[int], n: int) -> str:
    """One streaming call held open to its end: "ok", or what went wrong."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        counter[0] += 1
        if counter[0] == n:
            opened.set()
        return f"connect: {e.__class__.__name__}"
    try:
        writer.write(_request(key, True, "slow"))
        head = await reader.readuntil(b"\r\n\r\n")
        counter[0] += 1
        if counter[0] == n:
            opened.set()
        if not head.startswith(b"HTTP/1.1 200"):
            return "status " + head.split(b" ", 2)[1].decode()
        data = b""
        while b"[DONE]" not in data[-64:]:
            chunk = await reader.read(65536)
            if not chunk:
                return "cut short"
            data = data[-64:] + chunk
        return "ok"
    except (OSError, asyncio.IncompleteReadError) as e:
        return f"error: {e.__class__.__name__}"
    finally:
        writer.close()


async def hold_streams(gw: Gateway, keys: list[str]) -> dict[str, Any]:
    """Every key opens one stream at once; RSS sampled once all have their headers."""
    proc = psutil.Process(gw.proc.proc.pid)
    before = proc.memory_info().rss / 1e6
    opened, counter = asyncio.Event(), [0]
    t0 = time.monotonic()
    tasks = [asyncio.create_task(one_stream(gw.proc.port, k, opened, counter, len(keys))) for k in keys]
    await opened.wait()
    opened_s = time.monotonic() - t0
    peak = proc.memory_info().rss / 1e6
    fds = proc.num_fds()
    outcomes = await asyncio.gather(*tasks)
    held = sum(o == "ok" for o in outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o != "ok":
            errors[o] = errors.get(o, 0) + 1
    return {"streams_tried": len(keys), "open_streams_held": held, "errors_under_open_streams": len(keys) - held,
            "error_kinds": errors, "seconds_to_open_all": round(opened_s, 1), "gateway_rss_mb_before": round(before, 1),
            "gateway_rss_mb_all_open": round(peak, 1), "gateway_open_fds_all_open": fds,
            "rss_mb_per_open_stream": round((peak - before) / max(held, 1), 4),
            "seconds_total": round(time.monotonic() - t0, 1)}  # fmt: skip


async def serve_rollouts(gw: Gateway, keys: list[str], concurrency: int) -> dict[str, Any]:
    """One non-streamed call per key, `concurrency` at a time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for k in keys:
        queue.put_nowait(k)
    statuses: dict[str, int] = {}

    async def worker() -> None:
        while not queue.empty():
            key = queue.get_nowait()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.proc.port)
                writer.write(_request(key, False, "ok"))
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1].decode()
                length = int(
                    next(
                        x.split(b":")[1]
                        for x in head.split(b"\r\n")
                        if x.lower().startswith(b"content-length")
                    )
                )
                await reader.readexactly(length)
                writer.close()
            except (OSError, asyncio.IncompleteReadError, StopIteration) as e:
                status = e.__class__.__name__
            statuses[status] = statuses.get(status, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.monotonic() - t0
    served = statuses.get("200", 0)
    return {"rollouts": len(keys), "rollouts_served": served, "errors_serving_rollouts": len(keys) - served,
            "statuses": statuses, "calls_per_s": round(len(keys) / seconds, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run both phases and merge the rows into the results file."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=5000)
    p.add_argument("--stream-seconds", type=int, default=30)
    p.add_argument("--rollouts", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--out", type=Path, default=HERE.parent / "results" / "reliability.json")
    args = p.parse_args(argv)
    nofile = raise_nofile()
    with tempfile.TemporaryDirectory(prefix="harnessrl-load-") as tmp:
        work = Path(tmp)
        engine_url = slow_engine(work, args.stream_seconds)
        gw = start_gateway(work, engine_url)
        try:
            print(f"registering {args.streams} rollouts for the open streams ...", flush=True)
            streams = asyncio.run(hold_streams(gw, register(gw, args.streams)))
            print(json.dumps(streams), flush=True)
            print(f"registering and serving {args.rollouts} rollouts ...", flush=True)
            served = asyncio.run(serve_rollouts(gw, register(gw, args.rollouts), args.concurrency))
            print(json.dumps(served), flush=True)
        finally:
            gw.proc.stop()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    flags = argv if argv is not None else sys.argv[1:]
    results["load_held"] = {"command": "python -m bench.reliability.streams " + " ".join(flags),
                            "client_nofile": nofile, "stream_seconds": args.stream_seconds, **streams, **served}  # fmt: skip
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
