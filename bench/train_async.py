"""Async vs sync on a harness with a slow, long-tailed tool (`calc_slow`: lognormal latency, median 6 s).

Runs the same config twice — `train.schedule=sync`, then `async` — with the same seed, data, model and
number of training steps, and compares the wall-clock of the training phase (evaluation excluded) and
the held-out reward after training. Writes bench/results/async.json:
`speedup` (sync train wall / async train wall), `reward_sync`, `reward_async` (held-out greedy, with
95% intervals), and the per-run summaries.

    .venv/bin/python bench/train_async.py [--steps 6] [--out bench/results/async.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.run import run


def one(schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One full run (eval before, training, eval after) with the given schedule."""
    overrides = [
        f"run_dir={args.run_root}/{schedule}",
        f"train.schedule={schedule}",
        f"train.steps={args.steps}",
        f"eval.n_heldout={args.n_heldout}",
        *args.override,
    ]
    cfg = load_config(get_example("calc_slow").config_path, overrides)
    started = time.time()

    def on_step(step: int, m: dict[str, Any]) -> None:
        print(f"  {schedule} step {step}: reward {m['reward']:.3f}  step {m['time_step_s']:.1f}s  "
              f"update {m['time_update_s']:.1f}s  carried {m.get('groups_carried_over', 0)}", flush=True)  # fmt: skip

    summary = run(cfg, fresh=True, on_step=on_step)
    summary["bench_wall_seconds"] = time.time() - started
    return summary


def main() -> int:
    """Run both schedules and write the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-heldout", type=int, default=60)
    ap.add_argument("--run-root", default="runs/bench-async")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (a.b=value)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "async.json"))
    args = ap.parse_args()
    runs = {}
    for schedule in ("sync", "async"):
        print(f"== {schedule}", flush=True)
        runs[schedule] = one(schedule, args)
    s, a = runs["sync"], runs["async"]
    result = {
        "speedup": s["train_wall_seconds"] / a["train_wall_seconds"],
        "train_wall_sync_s": s["train_wall_seconds"],
        "train_wall_async_s": a["train_wall_seconds"],
        "reward_sync": s["heldout_reward_after"],
        "reward_async": a["heldout_reward_after"],
        "reward_sync_ci95": s["heldout_ci95_after"],
        "reward_async_ci95": a["heldout_ci95_after"],
        "reward_before": s["heldout_reward_before"],
        "steps": args.steps,
        "n_heldout": s["n_heldout"],
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'schedule':<8} {'train wall s':>12} {'held-out before':>16} {'held-out after':>22}")
    for name, r in runs.items():
        lo, hi = r["heldout_ci95_after"]
        print(f"{name:<8} {r['train_wall_seconds']:>12.0f} {r['heldout_reward_before']:>16.2f} "
              f"{r['heldout_reward_after']:>10.2f} [{lo:.2f}, {hi:.2f}]")  # fmt: skip
    print(f"speedup (sync / async train wall): {result['speedup']:.2f}x  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
