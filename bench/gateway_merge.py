"""Merge rate of multi-call rollouts, tito against passthrough, in one run.

The calc harness (an openai-SDK tool loop that echoes each answer back with `model_dump`) runs
`--rollouts` times at temperature 1.0 against SmolLM2-135M-Instruct (real tokenizer), once with the
gateway in each mode; the adapter then merges each rollout's calls. Writes
`bench/results/gateway_merge.json` with `merge_rate_tito`, `merge_rate_passthrough` and break causes.

    python bench/gateway_merge.py --rollouts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from harnessrl.adapter import MergeStats, merge_calls
from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.examples import get_example
from harnessrl.gateway.client import ControlClient
from harnessrl.modeling.loading import resolve_model
from harnessrl.schema import RolloutState, SamplingOverrides
from harnessrl.services import free_port, start_engine, start_gateway


async def _run_mode(mode: str, engine_url: str, model_dir: Path, work: Path, n: int) -> dict[str, Any]:
    admin = secrets.token_hex(16)
    gw = start_gateway(work / f"{mode}.sqlite", engine_url, free_port(), admin, work, 96, mode, model_dir)
    try:
        gw.wait_healthy()
        example = get_example("calc")
        tasks, _ = example.build_splits(n, 1, 7)
        client = ControlClient(gw.url, admin)
        ctl = Controller(client, gw.url, HarnessSpec(example.harness_command, timeout_s=600), example.grader,
                         work / mode, concurrency=32)  # fmt: skip
        sampling = SamplingOverrides(temperature=1.0)
        outcomes = await ctl.run([RolloutRequest(t, f"{mode}-{t.task_id}", sampling=sampling) for t in tasks])
        stats = MergeStats()
        for o in outcomes:
            if o.state == RolloutState.SUCCEEDED:
                stats.add(merge_calls((await client.rollout(o.rollout_id)).calls))
        await client.aclose()
        return stats.as_dict()
    finally:
        gw.stop()


def main(argv: list[str] | None = None) -> int:
    """Run both modes and write the results."""
    p = argparse.ArgumentParser(prog="python bench/gateway_merge.py")
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gateway_merge.json")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = start_engine(model_dir, free_port(), work, 32, 2048, None)
        try:
            engine.wait_healthy()
            results = {mode: asyncio.run(_run_mode(mode, engine.url, model_dir, work, args.rollouts))
                       for mode in ("passthrough", "tito")}  # fmt: skip
        finally:
            engine.stop()
    out = {
        "merge_rate_tito": results["tito"]["merge_rate"],
        "merge_rate_passthrough": results["passthrough"]["merge_rate"],
        "rollouts": args.rollouts,
        "model": args.model,
        "detail": results,
    }
    print(f"{'mode':<12}{'multi-call rollouts':>20}{'merged into 1 row':>19}{'merge rate':>12}  breaks")
    for mode, r in results.items():
        merged = round((r["merge_rate"] or 0) * r["multi_call_rollouts"])
        rate = "n/a" if r["merge_rate"] is None else f"{r['merge_rate']:.3f}"
        print(f"{mode:<12}{r['multi_call_rollouts']:>20}{merged:>19}{rate:>12}  {r['breaks']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
