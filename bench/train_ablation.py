"""The paper's ablation at CPU scale, on the multi-turn `calc_chain` task (rollouts of 2 to 20 calls):

  (a) sample-level advantage  + sample-mean loss
  (b) rollout-level advantage + sample-mean loss
  (c) rollout-level advantage + rollout-token-mean loss (the default)

Each setting × seed is a full run (eval before, training, eval after) from the same initial model, in
its own run directory. Writes bench/results/ablation.json (final held-out reward per setting and seed,
the training-reward and held-out curves) and docs/img/ablation.png (held-out reward against step with
`--eval-every 1`, else training reward against step; mean over seeds), and prints whether
(a) < (b) < (c) holds on the final held-out reward.

    .venv/bin/python bench/train_ablation.py [--seeds 0 1 2] [--steps 6] [--n-heldout 40] [--resume]

By default every call is its own row (`train.merge_calls=false`, Agent Lightning's transitions), so a
rollout's samples are its calls; `--merge-calls` keeps the default merging instead.

Each finished run is written to the JSON at once; `--resume` keeps the runs the JSON already holds
(same example, steps, held-out size and overrides — else it refuses) and runs only the missing ones.
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

SETTINGS: dict[str, list[str]] = {
    "a_sample_adv_sample_mean": ["train.advantage_level=sample", "train.loss_mode=sample_mean"],
    "b_rollout_adv_sample_mean": ["train.advantage_level=rollout", "train.loss_mode=sample_mean"],
    "c_rollout_adv_rollout_token_mean": [
        "train.advantage_level=rollout",
        "train.loss_mode=rollout_token_mean",
    ],
}


def one(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a setting with a seed (the seed picks the training tasks and sampling order)."""
    run_dir = Path(args.run_root) / f"{name}-s{seed}"
    overrides = [
        f"run_dir={run_dir}",
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"eval.n_heldout={args.n_heldout}",
        "eval.extra_temperatures=[]",
        f"eval.every={args.eval_every}",
        *SETTINGS[name],
        *([] if args.merge_calls else ["train.merge_calls=false"]),
        *args.override,
    ]
    cfg = load_config(get_example(args.example).config_path, overrides)
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
        "heldout_curve": summary["heldout_curve"],  # (step, held-out reward); every step with --eval-every 1
        "rows_per_rollout": summary["rows_per_rollout"],
        "calls_per_rollout": calls_per_rollout(run_dir),
        "wall_s": time.time() - t0,
    }


def calls_per_rollout(run_dir: Path) -> dict[str, float]:
    """How many calls the training rollouts made (min, mean, max), read from the run's store."""
    import sqlite3

    with sqlite3.connect(run_dir / "store.sqlite") as db:
        counts = [n for (n,) in db.execute(
            "SELECT COUNT(c.call_id) FROM rollouts r LEFT JOIN calls c ON c.rollout_id = r.rollout_id "
            "WHERE r.client_id LIKE '%-train-%' GROUP BY r.rollout_id")]  # fmt: skip
    if not counts:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": min(counts), "mean": sum(counts) / len(counts), "max": max(counts)}


def plot(results: list[dict[str, Any]], out: Path, example: str = "calc_chain") -> None:
    """Held-out reward against step (runs made with --eval-every) or else training reward against
    step, mean over seeds, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heldout = all(len(r.get("heldout_curve", [])) > 2 for r in results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in SETTINGS:
        runs = [r for r in results if r["setting"] == name]
        if not runs:
            continue
        if heldout:
            curves = [[y for _, y in r["heldout_curve"]] for r in runs]
            xs = [x for x, _ in runs[0]["heldout_curve"]]
        else:
            curves = [r["train_reward"] for r in runs]
            xs = list(range(1, min(len(c) for c in curves) + 1))
        n = min(len(c) for c in curves)
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        final = sum(r["heldout_after"] for r in runs) / len(runs)
        ax.plot(xs[:n], mean, marker="o", label=f"{name} (held-out after {final:.2f}, {len(runs)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{'held-out' if heldout else 'training'} reward (mean over seeds)")
    ax.set_title(f"Ablation on {example}: advantage level × loss normalisation")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def _mean_se(xs: list[float]) -> dict[str, Any]:
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else float("nan")
    return {"mean": mean, "se": (var / n) ** 0.5, "per_seed": xs}


def summarize(results: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per setting: the held-out reward after training and the mean of the held-out evaluations made
    after any training (steps > 0 of `heldout_curve`: with --eval-every, several evaluations, so less
    sampling noise) over seeds; paired by seed, the differences (b)-(a), (c)-(b), (c)-(a) of the
    held-out after, with their standard errors; whether (a) < (b) < (c) holds on either figure."""
    by = {(r["setting"], r["seed"]): r for r in results}
    names = [n for n in SETTINGS if any(r["setting"] == n for r in results)]

    def trained(r: dict[str, Any]) -> float:
        points = [y for x, y in r["heldout_curve"] if x > 0] or [r["heldout_after"]]
        return sum(points) / len(points)

    after = {n: sum(by[n, s]["heldout_after"] for s in seeds if (n, s) in by) / len(seeds) for n in names}
    during = {n: sum(trained(by[n, s]) for s in seeds if (n, s) in by) / len(seeds) for n in names}
    paired: dict[str, Any] = {}
    for hi, lo in ((1, 0), (2, 1), (2, 0)):
        h, lo_ = list(SETTINGS)[hi], list(SETTINGS)[lo]
        diffs = [
            by[h, s]["heldout_after"] - by[lo_, s]["heldout_after"]
            for s in seeds
            if (h, s) in by and (lo_, s) in by
        ]
        if diffs:
            paired[f"{'abc'[hi]}-{'abc'[lo]}"] = _mean_se(diffs)
    a, b, c = (after.get(n, float("nan")) for n in SETTINGS)
    ta, tb, tc = (during.get(n, float("nan")) for n in SETTINGS)
    return {"mean_heldout_after": after, "mean_heldout_trained": during, "paired_after": paired,
            "a_lt_b_lt_c": a < b < c, "a_lt_b_lt_c_trained": ta < tb < tc}  # fmt: skip


def previous_results(path: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs an earlier (possibly stopped) invocation wrote to `path`, if it ran the same ablation."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    old_key = {k: old.get(k, 0 if k == "eval_every" else None) for k in key}
    if old_key != key:
        raise SystemExit(f"--resume: {path} holds a different ablation ({old_key}), not {key}; "
                         "pass another --out or drop --resume")  # fmt: skip
    return list(old["results"])


def main() -> int:
    """Run every setting × seed, then write the JSON, the plot and the verdict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--example", default="calc_chain")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-heldout", type=int, default=40)
    ap.add_argument(
        "--merge-calls", action="store_true", help="merge calls into rows (default: a row per call)"
    )
    ap.add_argument("--run-root", default="runs/bench-ablation")
    ap.add_argument("--override", action="append", default=[], help="extra config overrides (a.b=value)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ablation.json"))
    ap.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" / "img" / "ablation.png"))
    ap.add_argument(
        "--eval-every", type=int, default=2, help="held-out evaluation every N steps (eval.every)"
    )
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out; run the rest")
    args = ap.parse_args()
    key = {
        "example": args.example,
        "steps": args.steps,
        "n_heldout": args.n_heldout,
        "overrides": args.override,
        "merge_calls": args.merge_calls,
        "eval_every": args.eval_every,
    }
    results = previous_results(Path(args.out), key) if args.resume else []
    done = {(r["setting"], r["seed"]) for r in results}
    for seed in args.seeds:
        for name in args.settings:
            if (name, seed) in done:
                print(f"== {name} seed {seed}: kept from {args.out}", flush=True)
                continue
            print(f"== {name} seed {seed}", flush=True)
            results.append(one(name, seed, args))
            Path(args.out).write_text(json.dumps({**key, "partial": True, "results": results}, indent=2))
    results = [r for r in results if r["setting"] in args.settings and r["seed"] in args.seeds]
    summary = summarize(results, args.seeds)
    out = {
        **key,
        "seeds": args.seeds,
        "command": " ".join(["python", *sys.argv]),
        **summary,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    plot(results, Path(args.plot), args.example)
    print(f"\n{'setting':<36} {'held-out after':>15} {'mean of evals after training':>30}")
    for name, m in summary["mean_heldout_after"].items():
        print(f"{name:<36} {m:>15.3f} {summary['mean_heldout_trained'][name]:>30.3f}")
    for pair, d in summary["paired_after"].items():
        print(f"{pair}: held-out after, paired by seed: {d['mean']:+.3f} ± {d['se']:.3f} (per seed "
              f"{', '.join(f'{x:+.3f}' for x in d['per_seed'])})")  # fmt: skip
    print(
        f"(a) < (b) < (c): {summary['a_lt_b_lt_c']} on held-out after, "
        f"{summary['a_lt_b_lt_c_trained']} on the mean of evaluations after training  -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
