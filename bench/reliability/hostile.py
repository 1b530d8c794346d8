"""The hostile harness against every runner that can run here, counted probe by probe (the last step of
`make bench-reliability`).

The harness, the run it attacks and the count are those of tests/controller/test_isolation.py
(`tests/support/hostile.py`): a real builtin engine on a tiny random model, a real gateway process over
a real SQLite store in a run directory protected as `harnessrl train` leaves it, another rollout's
harness running beside it. Per runner: the probes it tried, how many were refused, the names of those
that were not (`allowed`, which must be empty) and whether its own model call worked. The engine's port
counts under the sandboxes only: a uid of its own does not isolate the network (docs/security.md).

    python -m bench.reliability.hostile [--runners default sandbox-fork plain fork-server]

Updates the key `hostile_probes` of bench/results/reliability.json (the other keys are kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.hostile import (
    KINDS,
    ROOT,
    Run,
    attack,
    network_isolated,
    open_run,
    own_model_call_ok,
    refusals,
    runner_for,
)

from harnessrl.controller import Runner
from harnessrl.modeling.loading import make_tiny_model_dir
from harnessrl.services import free_port, start_engine

RESULTS = Path(__file__).resolve().parents[1] / "results" / "reliability.json"


async def probe_runner(run: Run, runner: Runner, kind: str) -> dict[str, Any]:
    """One attack on `runner`: the row of the results file."""
    t0 = time.monotonic()
    try:
        a = await attack(run, runner, kind)
    finally:
        runner.close()
    row: dict[str, Any] = {"runner": type(runner).__name__, "seconds": round(time.monotonic() - t0, 1)}
    if a.result.infra_error or a.result.exit_code != 0 or not a.probe:
        return row | {
            "error": a.result.infra_error or a.result.stderr_tail[-500:],
            "exit_code": a.result.exit_code,
        }
    isolated = network_isolated(runner)
    refused = refusals(a, run, isolated)
    allowed = [name for name, ok in refused.items() if not ok]
    row |= {"probes_tried": len(refused), "refused": len(refused) - len(allowed), "allowed": allowed,
            "own_model_call_ok": own_model_call_ok(a), "harness_uid": a.probe.get("uid"),
            "probes": list(refused)}  # fmt: skip
    if not isolated:
        why = "reachable without a sandbox, by design (docs/security.md)"
        row["not_counted"] = {"engine port": {"why": why, "harness_got": a.probe.get("engine port")}}
    return row


async def probe_all(engine_url: str, kinds: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Rows per runner that runs here, and why the others did not."""
    rows: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with open_run(engine_url) as run:
        for kind in kinds:
            runner = runner_for(kind)
            if isinstance(runner, str):
                skipped[kind] = runner
                print(f"{kind}: skipped ({runner})", flush=True)
                continue
            rows[kind] = await probe_runner(run, runner, kind)
            print(f"{kind}: {json.dumps(rows[kind])}", flush=True)
    return rows, skipped


def main(argv: list[str] | None = None) -> int:
    """Attack each runner and merge the rows into the results file."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runners", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="harnessrl-hostile-") as tmp:
        work = Path(tmp)
        engine = start_engine(
            make_tiny_model_dir(work / "model", seed=0), free_port(), work / "logs", 16, 2048, 1
        )
        try:
            engine.wait_healthy(120)
            rows, skipped = asyncio.run(probe_all(engine.url, args.runners))
        finally:
            engine.stop()
    flags = argv if argv is not None else sys.argv[1:]
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["hostile_probes"] = {"command": " ".join(["python -m bench.reliability.hostile", *flags]),
                                 "as_root": ROOT, "runners": rows, "skipped": skipped,
                                 "probes_allowed": sum(len(r.get("allowed", ())) for r in rows.values())}  # fmt: skip
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    failed = [
        k for k, r in rows.items() if r.get("allowed") or "error" in r or not r.get("own_model_call_ok")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
