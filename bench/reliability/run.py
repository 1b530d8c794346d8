"""`make bench-reliability`: the gateway's fault suite, all on loopback against the fault engine.

- kill -9: `--kill-runs` runs each of streamed and non-streamed load from `--concurrency` rollouts, the
  gateway SIGKILLed mid-load; `lost_calls` = answers delivered but missing from the reopened store;
- bad input: a corpus of 280+ cases (nesting, sizes, types, encodings, cross-API bodies, slow clients,
  disconnects); `server_errors_5xx` = answers >= 500 or streams cut without an error event, plus the
  errors that escaped the handlers (uvicorn's "Exception in ASGI application"); every rollout
  readable afterwards;
- WAL: `--wal-seconds` of non-streamed load at `--concurrency`; `wal_max_mb` (sampled every 50 ms);
- engine faults (500, hang, non-JSON, close mid-answer, bad event, killed): what the harness got and
  what was recorded;
- the event loop under a 100k-message request (the slowest /health meanwhile).

With `--baseline-ref REF` the bad-input corpus, the WAL run and the loop probe also run against the
gateway of git revision REF (exported to .bench/reliability-REF), for comparison in the same run.

    python -m bench.reliability.run [--quick] [--baseline-ref REF]

Writes bench/results/reliability.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench.reliability.client import start_engine, start_gateway
from bench.reliability.corpus import (
    cross_api_cases,
    encoding_cases,
    nesting_cases,
    run_corpus,
    size_cases,
    type_cases,
)
from bench.reliability.faults import engine_faults, loop_stall, metrics_need_key
from bench.reliability.load import kill_run, wal_run
from bench.reliability.slow import slow_and_disconnect_cases

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "reliability.json"
# Errors that escaped the handlers (uvicorn logs them; the client got no proper answer). A handler's
# own unhandled error (`event=unhandled_error` in the log) is answered 500 and counted among the answers.
LOG_ERRORS = re.compile(r"Exception in ASGI application")


def export_baseline(ref: str) -> str | None:
    """`src` of git revision `ref`, exported under .bench/; None when it cannot be."""
    dest = ROOT / ".bench" / f"reliability-{re.sub(r'[^A-Za-z0-9]', '_', ref)}"
    if not (dest / "src").exists():
        dest.mkdir(parents=True, exist_ok=True)
        try:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        except subprocess.CalledProcessError as e:
            print(f"baseline {ref!r} skipped: {e.stderr.decode(errors='replace')[:200]}", file=sys.stderr)
            return None
    return str(dest / "src")


async def corpus_run(work: Path, pythonpath: str | None) -> dict[str, Any]:
    """The bad-input corpus against one gateway (production settings, short header/body timeouts)."""
    engine = start_engine(work, tokens=8)
    flags = [] if pythonpath else ["--header-timeout", "3", "--body-timeout", "3"]
    gw = start_gateway(work, engine.url, flags, pythonpath=pythonpath)
    try:
        (rid, key), (_, key_slow) = gw.new_rollouts(2, prefix="corpus")
        cases = nesting_cases() + size_cases() + type_cases() + encoding_cases() + cross_api_cases()
        slow_cases = slow_and_disconnect_cases()
        result = await run_corpus(gw, cases, key, rid)
        slow = await run_corpus(gw, slow_cases, key_slow, rid, parallel=len(slow_cases))
        await asyncio.sleep(1.0)  # disconnected streams finish recording
        with httpx.Client(
            base_url=gw.proc.url, headers={"Authorization": f"Bearer {gw.admin}"}, timeout=60
        ) as c:
            page = c.get("/control/rollouts", params={"limit": 1000}).json()["rollouts"]
            unreadable = [
                r["rollout_id"]
                for r in page
                if c.get(f"/control/rollouts/{r['rollout_id']}").status_code != 200
            ]
            cancelled = sum(1 for call in c.get(f"/control/rollouts/{page[1]['rollout_id']}").json()["calls"]
                            if call.get("finish_reason") == "cancelled")  # fmt: skip
        alive = httpx.get(f"{gw.proc.url}/health", timeout=10).status_code == 200
        metrics = metrics_need_key(gw.proc.url, gw.admin)
    finally:
        gw.proc.stop()
        engine.stop()
    logged = sum(
        1 for line in gw.proc.log.read_text(errors="replace").splitlines() if LOG_ERRORS.search(line)
    )
    merged = {k: result[k] + slow[k] for k in ("cases", "server_errors_5xx")}
    return {**merged, "server_errors_logged": logged, "server_error_cases": {**result["server_error_cases"], **slow["server_error_cases"]},
            "unreadable_rollouts": len(unreadable), "alive_after": alive, "disconnected_streams_recorded_cancelled": cancelled,
            "metrics_status": metrics, "outcomes_by_category": {**result["outcomes_by_category"], **slow["outcomes_by_category"]},
            "outcomes": {**result["outcomes"], **slow["outcomes"]}}  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Every part of the suite, in turn; the summary and the details."""
    work = Path(tempfile.mkdtemp(prefix="reliability-"))
    t0 = time.monotonic()
    baseline = export_baseline(args.baseline_ref) if args.baseline_ref else None
    out: dict[str, Any] = {"command": " ".join(["python -m bench.reliability.run", *sys.argv[1:]])}
    print("bad-input corpus ...", flush=True)
    out["corpus"] = await corpus_run(work, None)
    print("kill -9 runs ...", flush=True)
    runs = []
    for i in range(args.kill_runs):
        for stream in (False, True):
            runs.append(await kill_run(work, stream, args.concurrency, args.kill_seconds))
            print(
                f"  run {i} stream={stream}: {runs[-1]['delivered']} delivered, {runs[-1]['lost']} lost",
                flush=True,
            )
    out["kill_runs_detail"] = runs
    print("engine faults ...", flush=True)
    out["engine_faults"] = await engine_faults(work)
    print(f"WAL under {args.wal_seconds:g} s of load ...", flush=True)
    out["wal"] = await wal_run(work, args.concurrency, args.wal_seconds)
    print("event loop under a 100k-message request ...", flush=True)
    out["loop_stall"] = await loop_stall(work)
    if baseline is not None:
        print(f"baseline {args.baseline_ref} ...", flush=True)
        out["baseline"] = {"ref": args.baseline_ref, "corpus": await corpus_run(work, baseline),
                           "wal": await wal_run(work, args.concurrency, args.wal_seconds, baseline),
                           "loop_stall": await loop_stall(work, baseline)}  # fmt: skip
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def summary(out: dict[str, Any]) -> dict[str, Any]:
    """The headline figures the issue asks for."""
    runs = out["kill_runs_detail"]
    s = {
        "lost_calls": sum(r["lost"] for r in runs),
        "kill_runs": len(runs),
        "delivered_calls": sum(r["delivered"] for r in runs),
        "store_integrity_ok": all(r["integrity_ok"] for r in runs),
        "bad_input_cases": out["corpus"]["cases"],
        "server_errors_5xx": out["corpus"]["server_errors_5xx"] + out["corpus"]["server_errors_logged"],
        "unreadable_rollouts": out["corpus"]["unreadable_rollouts"],
        "wal_max_mb": out["wal"]["wal_max_mb"],
        "wal_db_mb": out["wal"]["db_mb"],
        "engine_faults_clear": f"{out['engine_faults']['clear_failures']}/{out['engine_faults']['total']}",
        "loop_health_max_ms_100k_messages": out["loop_stall"]["health_max_ms_during"],
    }
    if "baseline" in out:
        b = out["baseline"]
        s["baseline"] = {"ref": b["ref"], "server_errors_5xx": b["corpus"]["server_errors_5xx"] + b["corpus"]["server_errors_logged"],
                         "unreadable_rollouts": b["corpus"]["unreadable_rollouts"], "wal_max_mb": b["wal"]["wal_max_mb"],
                         "wal_db_mb": b["wal"]["db_mb"], "loop_health_max_ms_100k_messages": b["loop_stall"]["health_max_ms_during"]}  # fmt: skip
    return s


def main() -> int:
    """Run the suite and write the results."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kill-runs", type=int, default=3, help="runs of each of streamed and non-streamed load")
    p.add_argument("--kill-seconds", type=float, default=8.0, help="load before each kill -9")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--wal-seconds", type=float, default=60.0)
    p.add_argument(
        "--baseline-ref", help="git revision whose gateway runs the corpus, WAL and loop probes too"
    )
    p.add_argument("--quick", action="store_true", help="shorter: 1 kill run of each kind, 15 s of WAL load")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.kill_runs, args.wal_seconds = 1, 15.0
    out = asyncio.run(main_async(args))
    out = {"summary": summary(out), **out}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
