"""Step credit against rollout-only credit on `calc_chain` (rollouts of 2 to 20 calls, where an early
wrong step costs every later one):

  rollout: every token of a rollout trained with its rollout-level advantage (the default)
  step:    `train.credit=step`: plus β × (the call's step reward − the group's mean at that call),
           the grader giving each call of a chain step 1 if the step was right, else 0 (docs/credit.md)

Each setting × seed is a full run (held-out before, training, held-out after) from the same initial
model in its own run directory, the rest of the config as the example has it. Writes
bench/results/credit.json: per setting and seed the held-out reward before and after, the training
rewards, the wall time; per setting the mean over seeds; paired by seed, step − rollout with its
standard error. Reports what happens, whichever way it goes.

    .venv/bin/python bench/train_credit.py [--seeds 0 1 2] [--steps 6] [--n-heldout 24] [--resume]
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
from harnessrl.runs.flow import run

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: its sibling, the ablation bench
from train_ablation import _mean_se  # mean, standard error and per-seed values

SETTINGS: dict[str, list[str]] = {
    "rollout": ["train.credit=rollout"],
    "step": ["train.credit=step", "train.step_coef=1.0"],
}


def one(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a setting with a seed (the seed picks the training tasks and the sampling order)."""
    run_dir = Path(args.run_root) / f"{name}-s{seed}"
    overrides = [
        f"run_dir={run_dir}",
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"eval.n_heldout={args.n_heldout}",
        "eval.extra_temperatures=[]",
        *SETTINGS[name],
        *args.override,
    ]
    cfg = load_config(get_example("calc_chain").config_path, overrides)
    t0 = time.time()
    summary = run(cfg, fresh=True, on_step=lambda step, m: print(f"  {name} s{seed} step {step}: "
                                                                   f"reward {m['reward']:.3f}", flush=True))  # fmt: skip
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {
        "setting": name,
        "seed": seed,
        "heldout_before": summary["heldout_reward_before"],
        "heldout_after": summary["heldout_reward_after"],
        "heldout_ci95_after": summary["heldout_ci95_after"],
        "n_heldout": summary["n_heldout"],
        "train_reward": [r["reward"] for r in records],
        "step_rewards": [r.get("step_rewards") for r in records],
        "rows_per_rollout": summary["rows_per_rollout"],
        "train_wall_s": summary["train_wall_seconds"],
        "wall_s": time.time() - t0,
    }


def summarize(results: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Means over seeds per setting, and step − rollout paired by seed."""
    by = {(r["setting"], r["seed"]): r for r in results}
    means: dict[str, Any] = {}
    for name in SETTINGS:
        runs = [by[name, s] for s in seeds if (name, s) in by]
        if runs:
            means[name] = {
                key: sum(r[key] for r in runs) / len(runs)
                for key in ("heldout_before", "heldout_after", "train_wall_s", "wall_s")
            }
    pairs = [s for s in seeds if ("step", s) in by and ("rollout", s) in by]
    paired = {
        key: _mean_se([by["step", s][key] - by["rollout", s][key] for s in pairs])
        for key in ("heldout_after", "train_wall_s")
    }
    return {"mean": means, "paired_step_minus_rollout": paired if pairs else {}}


def main() -> int:
    """Run every setting × seed, writing the JSON after each run, then the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-heldout", type=int, default=24)
    ap.add_argument("--run-root", default="runs/bench-credit")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (a.b=value)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "credit.json"))
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out; run the rest")
    args = ap.parse_args()
    key = {
        "example": "calc_chain",
        "steps": args.steps,
        "n_heldout": args.n_heldout,
        "overrides": args.override,
    }
    results: list[dict[str, Any]] = []
    if args.resume and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if {k: old.get(k) for k in key} != key:
            raise SystemExit(
                f"--resume: {args.out} holds other runs ({ {k: old.get(k) for k in key} }), not {key}"
            )
        results = list(old["results"])
    done = {(r["setting"], r["seed"]) for r in results}
    for seed in args.seeds:
        for name in SETTINGS:
            if (name, seed) in done:
                print(f"== {name} seed {seed}: kept from {args.out}", flush=True)
                continue
            print(f"== {name} seed {seed}", flush=True)
            results.append(one(name, seed, args))
            Path(args.out).write_text(json.dumps({**key, "partial": True, "results": results}, indent=2))
    summary = summarize(results, args.seeds)
    out = {
        **key,
        "seeds": args.seeds,
        "command": " ".join(["python", *sys.argv]),
        **summary,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    for name, m in summary["mean"].items():
        print(f"{name:<8} held-out {m['heldout_before']:.3f} -> {m['heldout_after']:.3f}, "
              f"training {m['train_wall_s']:.0f} s, run {m['wall_s']:.0f} s")  # fmt: skip
    for k, d in summary["paired_step_minus_rollout"].items():
        print(f"step - rollout, {k}: {d['mean']:+.3f} ± {d['se']:.3f} (per seed "
              f"{', '.join(f'{x:+.3f}' for x in d['per_seed'])})  -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
