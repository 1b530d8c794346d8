"""Learning from a teacher on the calc example: RL, on-policy distillation, distillation + RL, and SFT on
the teacher's recorded traces followed by RL, at equal RL steps, several seeds (issue 50).

    teacher  = RL on calc from SmolLM2-135M-Instruct (`--teacher-steps`), its last checkpoint
               (or `--teacher DIR`: a checkpoint this project trained, e.g. the demo's last step)
    traces   = a run of the teacher on the training tasks (`--trace-steps` steps at lr 1e-12, so every
               rollout is the teacher's; its eval before is the teacher's held-out)
    per seed, from the base student (SmolLM2-135M-Instruct), `--steps` steps each:
      rl          train.steps=S
      distill     train.teacher.model=TEACHER                      (reverse KL alone)
      distill_rl  train.teacher.model=TEACHER train.teacher.rl=true
      sft_rl      harnessrl sft --from traces (sft.min_reward), then RL from its checkpoint

Held-out greedy and T=1 before/after on the example's disjoint held-out tasks (`--n-heldout`), wall
time, and the share of the student-teacher gap each arm closes, (after − before) / (teacher − before),
per step and per minute of training. Writes bench/results/distill.json (every finished run at once).

    make bench-distill                                    # the full bench: hours on 2 cores
    nice -n 5 .venv/bin/python bench/distill.py --seeds 0 --steps 1 --teacher-steps 1 --trace-steps 1 \\
        --n-heldout 4 --override train.batch_groups=1 --override train.group_size=2 --smoke   # minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from harnessrl.config import load_config
from harnessrl.examples import example_config
from harnessrl.runs.flow import run
from harnessrl.trainer.checkpoint import latest_checkpoint
from harnessrl.trainer.sft import run_sft

ARMS = ("rl", "distill", "distill_rl", "sft_rl")


def _heldout(summary: dict[str, Any], when: str) -> dict[str, float]:
    """Held-out reward per eval temperature ('0', '1') before or after."""
    return {t: r[when]["mean"] for t, r in summary["heldout_by_temperature"].items()}


def _run(name: str, args: argparse.Namespace, overrides: list[str]) -> tuple[dict[str, Any], Path]:
    run_dir = Path(args.run_root) / name
    cfg = load_config(example_config("calc"), [
        f"run_dir={run_dir}", f"eval.n_heldout={args.n_heldout}", "eval.extra_temperatures=[1.0]",
        *args.override, *overrides,
    ])  # fmt: skip
    print(f"run {name}: {' '.join(overrides)}", flush=True)
    summary = run(cfg, fresh=True, check=False)
    return summary, run_dir


def train_teacher(args: argparse.Namespace, out: dict[str, Any]) -> Path:
    """The teacher's folder: `--teacher`, or RL on calc from the base model here (its last checkpoint)."""
    if args.teacher:
        return Path(args.teacher).resolve()
    summary, run_dir = _run("teacher", args, [f"train.steps={args.teacher_steps}", "train.seed=100"])
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, "the teacher run saved no checkpoint"
    out["teacher_training"] = {"steps": args.teacher_steps, "heldout_before": _heldout(summary, "before"),
                               "heldout_after": _heldout(summary, "after"), "wall_s": summary["wall_seconds"]}  # fmt: skip
    return ckpt


def record_traces(args: argparse.Namespace, teacher: Path, out: dict[str, Any]) -> Path:
    """A run of the teacher on the training tasks (lr 1e-12: every rollout is the teacher's); its eval
    before is the teacher's held-out."""
    summary, traces = _run("traces", args, [f"engine.model={teacher}", f"train.steps={args.trace_steps}",
                                            "train.lr=1e-12", "train.seed=200"])  # fmt: skip
    out["teacher"]["heldout"] = _heldout(summary, "before")
    return traces


def one(arm: str, seed: int, args: argparse.Namespace, teacher: Path, traces: Path | None) -> dict[str, Any]:
    """One arm with one seed: held-out before/after, wall time, SFT figures where there is SFT."""
    base = [f"train.seed={seed}", f"train.steps={args.steps}"]
    extra: dict[str, Any] = {}
    if arm == "distill":
        base.append(f"train.teacher.model={teacher}")
    elif arm == "distill_rl":
        base += [f"train.teacher.model={teacher}", "train.teacher.rl=true"]
    elif arm == "sft_rl":
        sft_dir = Path(args.run_root) / f"sft-s{seed}"
        cfg = load_config(example_config("calc"), [f"run_dir={sft_dir}", f"train.seed={seed}",
                          f"sft.min_reward={args.sft_min_reward}", f"sft.epochs={args.sft_epochs}", *args.override])  # fmt: skip
        assert traces is not None
        sft = run_sft(cfg, traces, fresh=True)
        extra["sft"] = {k: sft[k] for k in ("rows", "steps", "target_logprob_before", "target_logprob_after",
                                            "wall_seconds")}  # fmt: skip
        base.append(f"engine.model={sft['checkpoint']}")
    t0 = time.time()
    summary, run_dir = _run(f"{arm}-s{seed}", args, base)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {
        "arm": arm, "seed": seed, "steps": args.steps, "n_heldout": summary["n_heldout"],
        "heldout_before": _heldout(summary, "before"), "heldout_after": _heldout(summary, "after"),
        "train_wall_s": summary["train_wall_seconds"], "wall_s": time.time() - t0,
        "train_reward": [r.get("reward") for r in records],
        "distill_reverse_kl": [r["distill_reverse_kl"] for r in records if "distill_reverse_kl" in r],
        **extra,
    }  # fmt: skip


def gap_closed(r: dict[str, Any], teacher: dict[str, float] | None, temp: str) -> dict[str, float | None]:
    """Share of the student-teacher gap closed, in all, per step and per minute of training (+ SFT)."""
    gap = teacher[temp] - r["heldout_before"][temp] if teacher else 0.0
    if abs(gap) < 1e-9:
        return {"total": None, "per_step": None, "per_minute": None}
    share = (r["heldout_after"][temp] - r["heldout_before"][temp]) / gap
    minutes = (r["train_wall_s"] + r.get("sft", {}).get("wall_seconds", 0.0)) / 60
    return {"total": share, "per_step": share / r["steps"], "per_minute": share / max(minutes, 1e-9)}


def summarize(results: list[dict[str, Any]], teacher: dict[str, float] | None) -> dict[str, Any]:
    """Per arm and eval temperature: held-out after (mean, sd, per seed) and the gap closed."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        runs = [r for r in results if r["arm"] == arm]
        if not runs:
            continue
        out[arm] = {}
        for temp in runs[0]["heldout_after"]:
            after = [r["heldout_after"][temp] for r in runs]
            closed = [gap_closed(r, teacher, temp)["total"] for r in runs]
            out[arm][temp] = {
                "after_mean": statistics.fmean(after), "after_sd": statistics.stdev(after) if len(after) > 1 else None,
                "after_per_seed": after, "gap_closed_per_seed": closed,
            }  # fmt: skip
    return out


def main() -> None:
    """Run the arms (see the module docstring) and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--n-heldout", type=int, default=100)
    p.add_argument("--teacher", help="a model folder this project trained (default: train one here)")
    p.add_argument("--teacher-steps", type=int, default=14)
    p.add_argument("--trace-steps", type=int, default=2)
    p.add_argument("--sft-min-reward", type=float, default=1.0)
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--override", action="append", default=[], help="a dotted override for every run")
    p.add_argument("--run-root", default="runs/bench-distill")
    p.add_argument("--out", type=Path, default=Path("bench/results/distill.json"))
    p.add_argument("--smoke", action="store_true", help="mark the JSON as a tiny-scale check, not figures")
    args = p.parse_args()
    out: dict[str, Any] = {"bench": "distill", "args": {k: v for k, v in vars(args).items() if k != "out"},
                           "status": "smoke: a tiny-scale check that the bench runs, not a measurement" if args.smoke
                           else "full", "results": []}  # fmt: skip
    t0 = time.time()
    teacher = train_teacher(args, out)
    out["teacher"] = {"model": str(teacher), "heldout": None}  # measured by the traces run (SFT arm)
    traces = record_traces(args, teacher, out) if "sft_rl" in args.arms else None
    for seed in args.seeds:
        for arm in args.arms:
            out["results"].append(one(arm, seed, args, teacher, traces))
            out["summary"] = summarize(out["results"], out["teacher"]["heldout"])
            out["wall_s"] = time.time() - t0
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
