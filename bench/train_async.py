"""Async vs sync on a harness with a slow, long-tailed tool (`calc_slow`: lognormal latency, median 6 s).

For each seed, runs the same config twice — `train.schedule=sync`, then `async` — with the same seed,
data, model and number of training steps, and compares the wall-clock of the training phase
(evaluation excluded) and the held-out reward after training. One pair per seed: the tool latencies
and samples a run draws differ from run to run, and a single sync run varied by ~2x across runs, so
the figure to read is the median of the per-seed ratios. Writes bench/results/async.json: `speedup`
(median over seeds of sync train wall / async train wall), `reward_sync`, `reward_async` (held-out
greedy, mean over seeds), the per-seed pairs and the per-run summaries.

    .venv/bin/python bench/train_async.py [--seeds 0 1 2] [--steps 6] [--out bench/results/async.json]

A variant of the async arm against the same sync runs (they do not depend on async-only settings):
    ... --async-override train.max_inflight_groups=12 --sync-from bench/results/async.json --out X.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.runs.flow import run


def one(schedule: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One full run (eval before, training, eval after) with the given schedule and seed."""
    overrides = [
        f"run_dir={args.run_root}/s{seed}-{schedule}",
        f"train.schedule={schedule}",
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"eval.n_heldout={args.n_heldout}",
        *args.override,
        *(args.async_override if schedule == "async" else []),
    ]
    cfg = load_config(get_example("calc_slow").config_path, overrides)
    started = time.time()

    def on_step(step: int, m: dict[str, Any]) -> None:
        print(f"  s{seed} {schedule} step {step}: reward {m['reward']:.3f}  step {m['time_step_s']:.1f}s  "
              f"update {m['time_update_s']:.1f}s  carried {m.get('groups_carried_over', 0)}", flush=True)  # fmt: skip

    summary = run(cfg, fresh=True, on_step=on_step)
    summary["bench_wall_seconds"] = time.time() - started
    summary["overrides"] = overrides
    return summary


def pair_result(s: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """The comparison of one seed's sync and async runs."""
    return {
        "speedup": s["train_wall_seconds"] / a["train_wall_seconds"],
        "train_wall_sync_s": s["train_wall_seconds"],
        "train_wall_async_s": a["train_wall_seconds"],
        "reward_before": s["heldout_reward_before"],
        "reward_sync": s["heldout_reward_after"],
        "reward_async": a["heldout_reward_after"],
        "reward_sync_ci95": s["heldout_ci95_after"],
        "reward_async_ci95": a["heldout_ci95_after"],
    }


def write(args: argparse.Namespace, pairs: dict[int, dict[str, Any]], runs: dict[str, Any]) -> dict[str, Any]:
    """Write the results of the pairs done so far (after every pair: a stopped bench keeps them)."""
    ratios = [p["speedup"] for p in pairs.values()]
    result = {
        "speedup": statistics.median(ratios),
        "speedups": ratios,
        "train_wall_sync_s": statistics.median(p["train_wall_sync_s"] for p in pairs.values()),
        "train_wall_async_s": statistics.median(p["train_wall_async_s"] for p in pairs.values()),
        "reward_sync": statistics.fmean(p["reward_sync"] for p in pairs.values()),
        "reward_async": statistics.fmean(p["reward_async"] for p in pairs.values()),
        "reward_before": statistics.fmean(p["reward_before"] for p in pairs.values()),
        "seeds": sorted(pairs),
        "steps": args.steps,
        "n_heldout": args.n_heldout,
        "overrides": args.override,
        "async_overrides": args.async_override,
        "command": " ".join(["python", *sys.argv]),
        "pairs": {str(k): v for k, v in pairs.items()},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def reused_runs(path: Path, args: argparse.Namespace, schedules: tuple[str, ...]) -> dict[str, Any]:
    """The runs of `schedules` in an earlier result file, if it ran the same workload (refuses
    otherwise; the async arm's own overrides must match too when its runs are reused)."""
    old = json.loads(path.read_text())
    same = (old.get("steps"), old.get("n_heldout"), old.get("overrides")) == (
        args.steps,
        args.n_heldout,
        args.override,
    )
    if "async" in schedules:
        same = same and old.get("async_overrides", []) == args.async_override
    if not same:
        raise SystemExit(f"{path}: different steps, held-out size or overrides; cannot reuse its runs")
    return {k: v for k, v in old["runs"].items() if k.rsplit("-", 1)[1] in schedules}


def main() -> int:
    """Run both schedules per seed and write the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-heldout", type=int, default=60)
    ap.add_argument("--run-root", default="runs/bench-async")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (a.b=value)")
    ap.add_argument("--async-override", action="append", default=[], help="overrides for the async arm only")
    ap.add_argument(
        "--sync-from",
        help="an earlier result JSON whose sync runs (same steps, held-out size, overrides) to reuse per seed",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "async.json"))
    ap.add_argument("--resume", action="store_true", help="keep the runs --out already holds; run the rest")
    args = ap.parse_args()
    pairs: dict[int, dict[str, Any]] = {}
    runs: dict[str, Any] = {}
    if args.sync_from:
        runs.update(reused_runs(Path(args.sync_from), args, ("sync",)))
    if args.resume and Path(args.out).exists():
        runs.update(reused_runs(Path(args.out), args, ("sync", "async")))
    for seed in args.seeds:
        for schedule in ("sync", "async"):
            if f"s{seed}-{schedule}" in runs:
                print(f"== seed {seed} {schedule}: reused from an earlier result file", flush=True)
                continue
            print(f"== seed {seed} {schedule}", flush=True)
            runs[f"s{seed}-{schedule}"] = one(schedule, seed, args)
        pairs[seed] = pair_result(runs[f"s{seed}-sync"], runs[f"s{seed}-async"])
        result = write(args, pairs, runs)
        p = pairs[seed]
        print(f"seed {seed}: sync {p['train_wall_sync_s']:.0f} s, async {p['train_wall_async_s']:.0f} s, "
              f"{p['speedup']:.2f}x; held-out {p['reward_before']:.2f} -> sync {p['reward_sync']:.2f}, "
              f"async {p['reward_async']:.2f}", flush=True)  # fmt: skip
    print(f"\n{'seed':<5} {'sync s':>7} {'async s':>8} {'ratio':>6} {'before':>7} {'sync':>5} {'async':>6}")
    for seed, p in pairs.items():
        print(f"{seed:<5} {p['train_wall_sync_s']:>7.0f} {p['train_wall_async_s']:>8.0f} {p['speedup']:>6.2f} "
              f"{p['reward_before']:>7.2f} {p['reward_sync']:>5.2f} {p['reward_async']:>6.2f}")  # fmt: skip
    print(f"median speedup (sync / async train wall): {result['speedup']:.2f}x  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
