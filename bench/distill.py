"""Learning from a teacher on the calc example: RL, on-policy distillation, distillation + RL, and SFT on
the teacher's recorded traces followed by RL, at equal RL steps, several seeds (issue 50).

    teacher  = `--teacher DIR`: a checkpoint this project trained (the demo's last step), or, without
               it, RL on calc from SmolLM2-135M-Instruct here (`--teacher-steps`), its last checkpoint
    once     = held-out of the base student and of the teacher (`harnessrl eval`, greedy and T=1): every
               arm starts from the same base model, so its "before" is measured once, not per run
    traces   = a run of the teacher on the training tasks (`--trace-groups` tasks × 2 rollouts at T=1,
               one step at lr 1e-12: every rollout is the teacher's; no held-out evaluation)
    per seed, from the base student (SmolLM2-135M-Instruct), `--steps` RL steps each (eval.before off):
      rl          train.steps=S
      distill     train.teacher.model=TEACHER                      (reverse KL alone)
      distill_rl  train.teacher.model=TEACHER train.teacher.rl=true
      sft_rl      harnessrl sft --from traces (sft.min_reward, seed S), then RL from its checkpoint

Every run is a subprocess (`harnessrl train|sft|eval`, the memory of each returned when it ends). Held-out
greedy and T=1 on the example's disjoint held-out tasks (the first `--n-heldout`), wall time, and the share
of the student-teacher gap each arm closes, (after − before) / (teacher − before), in all, per RL step and
per minute of training (SFT's minutes included). bench/results/distill.json is rewritten after every
finished run (`--resume` continues a cut bench from it).

    make demo && make bench-distill              # teacher: runs/demo's last checkpoint; hours on 2 cores
    nice -n 5 .venv/bin/python bench/distill.py --teacher DIR --seeds 0 --steps 1 --n-heldout 4 \\
        --trace-groups 2 --override train.batch_groups=1 --override train.group_size=2 --smoke   # minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from harnessrl.examples import example_config

ARMS = ("rl", "distill", "distill_rl", "sft_rl")
CLI = [sys.executable, "-c", "import sys; from harnessrl.cli import main; sys.exit(main())"]


def _q(value: object) -> str:
    """A dotted override's value as JSON (a path with spaces or non-ASCII letters reads back unchanged)."""
    return json.dumps(str(value))


def harnessrl(args: argparse.Namespace, name: str, command: list[str]) -> float:
    """`harnessrl COMMAND` in a subprocess, its output appended to `<run_root>/logs/NAME.txt`; returns its
    wall seconds. A failure stops the bench (the log says why)."""
    log = Path(args.run_root) / "logs" / f"{name}.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ harnessrl {' '.join(command)}", flush=True)
    t0 = time.time()
    with log.open("a") as f:
        f.write(f"\n$ harnessrl {' '.join(command)}\n")
        f.flush()
        rc = subprocess.run([*CLI, *command], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"harnessrl {command[0]} failed (exit {rc}); see {log}")
    return time.time() - t0


def common(args: argparse.Namespace) -> list[str]:
    """The overrides of every command: the held-out size, both eval temperatures, `--override`s."""
    return [f"eval.n_heldout={args.n_heldout}", "eval.temperature=0", "eval.extra_temperatures=[1.0]",
            *args.override]  # fmt: skip


def evaluate(args: argparse.Namespace, name: str, model: Path | str) -> dict[str, Any]:
    """Held-out of one model folder at T=0 and T=1 (`harnessrl eval`): {temperature: eval dict}."""
    out = Path(args.run_root) / f"eval-{name}.json"
    wall = harnessrl(args, f"eval-{name}", ["eval", "--config", str(example_config("calc")), "--model", str(model),
                            "--out", str(out), *common(args)])  # fmt: skip
    result = json.loads(out.read_text())
    return {"model": str(model), "wall_s": wall, "by_temperature": result["heldout_by_temperature"]}


def from_reference_run(run_dir: Path, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The base student's and the teacher's held-out read from a run of calc from the base model whose
    last step is the teacher (the demo: its evaluation before is the base student, its evaluation after
    the teacher), on its first `n` held-out tasks, which must be this bench's (checked by question)."""
    from harnessrl.examples.calc.task import build_splits

    _, heldout = build_splits(1000, n)
    theirs = [json.loads(x) for x in (run_dir / "data" / "heldout.jsonl").read_text().splitlines()[:n]]
    if [t.input["question"] for t in heldout] != [t["input"]["question"] for t in theirs]:
        raise SystemExit(f"{run_dir}'s first {n} held-out tasks are not this bench's")
    lines = (run_dir / "rollouts" / "index.tsv").read_text().splitlines()
    rows = [dict(zip(lines[0].split("\t"), x.split("\t"), strict=True)) for x in lines[1:]]
    wanted = {t.task_id for t in heldout}
    last = max(int(r["step"]) for r in rows if r["eval_label"].startswith("eval-after-"))

    def result(label: str) -> dict[str, Any]:
        mine = [r for r in rows if r["eval_label"] == label and r["task_id"] in wanted]
        rewards = [float(r["reward"]) for r in mine if r["reward"]]
        return {"mean": statistics.fmean(rewards) if rewards else None, "n": len(rewards), "failed": len(mine) - len(rewards),
                "label": label}  # fmt: skip

    source = f"{run_dir} (rollouts/index.tsv, first {n} held-out tasks)"
    student = {"model": "smollm2", "source": source,
               "by_temperature": {t: result(f"eval-before-t{t}") for t in ("0", "1")}}  # fmt: skip
    teacher = {"source": source, "by_temperature": {t: result(f"eval-after-{last}-t{t}") for t in ("0", "1")}}
    return student, teacher


def train(args: argparse.Namespace, name: str, overrides: list[str]) -> dict[str, Any]:
    """One `harnessrl train` run of calc in `<run_root>/NAME` (no preflight, no checkpoints unless
    asked); returns its summary.json with the wall seconds of the subprocess."""
    run_dir = Path(args.run_root) / name
    wall = harnessrl(args, name, ["train", "--config", str(example_config("calc")), "--fresh", "--no-check",
                            f"run_dir={_q(run_dir)}", "train.checkpoint_every=0", *common(args), *overrides])  # fmt: skip
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["process_wall_s"] = wall
    return summary


def teacher_folder(args: argparse.Namespace, out: dict[str, Any]) -> Path:
    """The teacher: `--teacher`, or RL on calc from the base model here (its last checkpoint)."""
    if args.teacher:
        folder = Path(args.teacher).resolve()
        if not (folder / "config.json").is_file():
            raise SystemExit(
                f"--teacher {folder}: no model folder there (make demo writes runs/demo/checkpoints)"
            )
        return folder
    s = train(args, "teacher", [f"train.steps={args.teacher_steps}", "train.seed=100",
                                f"train.checkpoint_every={args.teacher_steps}"])  # fmt: skip
    out["teacher_training"] = {"steps": args.teacher_steps, "wall_s": s["wall_seconds"]}
    return Path(s["run_dir"]) / "checkpoints" / f"step-{args.teacher_steps}"


def record_traces(args: argparse.Namespace, teacher: Path) -> dict[str, Any]:
    """The teacher on `--trace-groups` training tasks × 2 rollouts (lr 1e-12: every rollout is the
    teacher's); no held-out evaluation (one greedy task after, the least a run evaluates)."""
    s = train(args, "traces", [f"engine.model={_q(teacher)}", "train.steps=1", "train.lr=1e-12",
                               "train.seed=200", f"train.batch_groups={args.trace_groups}", "train.group_size=2",
                               "eval.before=false", "eval.n_heldout=1", "eval.extra_temperatures=[]"])  # fmt: skip
    return {"run_dir": s["run_dir"], "rollouts": s["rollouts_per_step"], "reward": s["train_reward_first"],
            "wall_s": s["process_wall_s"]}  # fmt: skip


def sft(args: argparse.Namespace, seed: int, traces: str) -> dict[str, Any]:
    """`harnessrl sft` of the base student on the teacher's traces, seed `seed`; returns sft.json."""
    run_dir = Path(args.run_root) / f"sft-s{seed}"
    harnessrl(args, f"sft-s{seed}", ["sft", "--config", str(example_config("calc")), "--from", traces, "--fresh",
                     f"run_dir={_q(run_dir)}", f"train.seed={seed}", f"sft.min_reward={args.sft_min_reward}",
                     f"sft.epochs={args.sft_epochs}", *args.override])  # fmt: skip
    result: dict[str, Any] = json.loads((run_dir / "sft.json").read_text())
    return result


def one(arm: str, seed: int, args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """One arm with one seed: held-out after (before: the base student's, measured once), wall time, the
    per-step training reward and reverse KL, SFT's figures where there is SFT."""
    teacher = out["teacher"]["model"]
    overrides = [f"train.seed={seed}", f"train.steps={args.steps}", "eval.before=false"]
    extra: dict[str, Any] = {}
    if arm in ("distill", "distill_rl"):
        overrides.append(f"train.teacher.model={_q(teacher)}")
        overrides += ["train.teacher.rl=true"] if arm == "distill_rl" else []
    elif arm == "sft_rl":
        s = sft(args, seed, out["traces"]["run_dir"])
        extra["sft"] = {k: s[k] for k in ("rows", "steps", "target_logprob_before", "target_logprob_after",
                                          "wall_seconds", "report")}  # fmt: skip
        overrides.append(f"engine.model={_q(s['checkpoint'])}")
        if args.sft_heldout:  # the SFT checkpoint's own held-out: the RL run's evaluation before
            overrides.append("eval.before=true")
    s = train(args, f"{arm}-s{seed}", overrides)
    records = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x]
    by_temp = s["heldout_by_temperature"]
    if arm == "sft_rl" and args.sft_heldout:
        extra["sft"]["heldout"] = {t: r["before"]["mean"] for t, r in by_temp.items()}
    return {
        "arm": arm, "seed": seed, "steps": s["train_steps"], "rollouts_per_step": s["rollouts_per_step"],
        "heldout_after": {t: r["after"]["mean"] for t, r in by_temp.items()},
        "heldout_after_failed": {t: r["after"]["failed"] for t, r in by_temp.items()},
        "train_wall_s": s["train_wall_seconds"], "run_wall_s": s["process_wall_s"],
        "train_reward": [r.get("reward") for r in records],
        "distill_reverse_kl": [r["distill_reverse_kl"] for r in records if "distill_reverse_kl" in r],
        **extra,
    }  # fmt: skip


def gap_closed(r: dict[str, Any], before: float, teacher: float) -> dict[str, float | None]:
    """Share of the student-teacher gap an arm's run closed: in all, per RL step, per minute of training
    (SFT's minutes included)."""
    gap = teacher - before
    if abs(gap) < 1e-9:
        return {"total": None, "per_step": None, "per_minute": None}
    share = (r["heldout_after"][r["_t"]] - before) / gap
    minutes = (r["train_wall_s"] + r.get("sft", {}).get("wall_seconds", 0.0)) / 60
    return {"total": share, "per_step": share / r["steps"], "per_minute": share / max(minutes, 1e-9)}


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None, "per_seed": xs}


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Per arm and eval temperature: held-out after and its change from the base student (mean, sd over
    seeds, per seed), the gap closed, and whether the mean change exceeds the seed spread (sd of after)."""
    summary: dict[str, Any] = {}
    base, teacher = out["student"]["by_temperature"], out["teacher"]["by_temperature"]
    for arm in ARMS:
        runs = [r for r in out["results"] if r["arm"] == arm]
        if not runs:
            continue
        summary[arm] = {"seeds": [r["seed"] for r in runs]}
        for t in runs[0]["heldout_after"]:
            before = base[t]["mean"]
            after = _spread([r["heldout_after"][t] for r in runs])
            change = _spread([a - before for a in after["per_seed"]])
            closed = [gap_closed({**r, "_t": t}, before, teacher[t]["mean"]) for r in runs]
            summary[arm][t] = {
                "before": before, "teacher": teacher[t]["mean"], "after": after, "change": change,
                "change_exceeds_seed_sd": None if after["sd"] is None else abs(change["mean"]) > after["sd"],
                "gap_closed": {k: _spread([float(c[k] or 0.0) for c in closed]) if closed[0][k] is not None
                               else None for k in ("total", "per_step", "per_minute")},
                "train_minutes": _spread([(r["train_wall_s"] + r.get("sft", {}).get("wall_seconds", 0.0)) / 60
                                          for r in runs]),
            }  # fmt: skip
    return summary


def table(out: dict[str, Any]) -> str:
    """The summary as a Markdown table (docs/distillation.md): one line per arm and eval temperature."""

    def pm(x: dict[str, Any] | None, digits: int = 3) -> str:
        if x is None:
            return "—"
        sd = "" if x["sd"] is None else f" ± {x['sd']:.{digits}f}"
        return f"{x['mean']:.{digits}f}{sd}"

    lines = ["| arm | T | before | after (mean ± sd) | after per seed | change | gap closed | per RL step "
             "| per minute | training |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, by_t in out["summary"].items():
        for t in ("0", "1"):
            r = by_t[t]
            g = r["gap_closed"] or {"total": None, "per_step": None, "per_minute": None}
            seeds = ", ".join(f"{x:.3f}" for x in r["after"]["per_seed"])
            lines.append(f"| {arm} | {t} | {r['before']:.3f} | {pm(r['after'])} | {seeds} | {pm(r['change'])} | "
                         f"{pm(g['total'], 2)} | {pm(g['per_step'], 3)} | {pm(g['per_minute'], 3)} | "
                         f"{r['train_minutes']['mean']:.1f} min |")  # fmt: skip
    return "\n".join(lines)


def write(args: argparse.Namespace, out: dict[str, Any], t0: float) -> None:
    """The JSON as it stands (after every finished run, so a cut bench still leaves its figures)."""
    out["wall_s"] = out.get("wall_s_before_resume", 0.0) + time.time() - t0
    if out.get("student") and out.get("teacher", {}).get("by_temperature"):
        out["summary"] = summarize(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str))


def parse() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8, help="RL steps of every arm")
    p.add_argument("--n-heldout", type=int, default=100)
    p.add_argument("--teacher", help="a model folder this project trained (default: train one here)")
    p.add_argument("--teacher-steps", type=int, default=14)
    p.add_argument("--trace-groups", type=int, default=32, help="training tasks the teacher's traces cover")
    p.add_argument("--sft-min-reward", type=float, default=1.0)
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--sft-heldout", action="store_true", help="also evaluate each SFT checkpoint")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--override", action="append", default=[], help="a dotted override for every run")
    p.add_argument("--run-root", default="runs/bench-distill")
    p.add_argument("--out", type=Path, default=Path("bench/results/distill.json"))
    p.add_argument(
        "--reference-run",
        help="a run of calc from the base model whose last step is the teacher "
        "(the demo's run directory): the base student's and the teacher's held-out are read from "
        "its evaluations before and after instead of evaluated again",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each a subprocess)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out, run the rest")
    p.add_argument(
        "--table", action="store_true", help="print --out's summary as a Markdown table, run nothing"
    )
    p.add_argument("--smoke", action="store_true", help="mark the JSON as a tiny-scale check, not figures")
    return p.parse_args()


def main() -> None:
    """Run the arms (see the module docstring), writing the JSON after every run."""
    args = parse()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    t0 = time.time()
    out: dict[str, Any] = json.loads(args.out.read_text()) if args.resume and args.out.exists() else {}
    out["wall_s_before_resume"] = out.get("wall_s", 0.0)
    out.update({"bench": "distill", "args": {k: v for k, v in vars(args).items() if k != "out"},
                "status": "smoke: a tiny-scale check that the bench runs, not a measurement" if args.smoke
                else "measurement", "results": out.get("results", []),
                "scale": f"{len(args.seeds)} seeds x {len(args.arms)} arms, {args.steps} RL steps each, "
                         f"{args.n_heldout} held-out tasks at T=0 and T=1, traces of {args.trace_groups} tasks x 2, "
                         f"SFT {args.sft_epochs} epoch(s); overrides: {' '.join(args.override) or 'none'}",
                "before_note": "every arm starts from the same base student: its held-out (student) is measured "
                               "once by harnessrl eval and is every arm's before; runs skip it (eval.before=false)"})  # fmt: skip
    if not out.get("teacher"):
        out["teacher"] = {"model": str(teacher_folder(args, out))}
    if args.reference_run and not out.get("student"):
        out["student"], teacher = from_reference_run(Path(args.reference_run), args.n_heldout)
        out["teacher"].update(teacher)
    if not out.get("student"):
        out["student"] = evaluate(args, "student", "smollm2")
        write(args, out, t0)
    if not out["teacher"].get("by_temperature"):
        out["teacher"].update(evaluate(args, "teacher", out["teacher"]["model"]))
        write(args, out, t0)
    if "sft_rl" in args.arms and not out.get("traces"):
        out["traces"] = record_traces(args, Path(out["teacher"]["model"]))
        write(args, out, t0)
    done = {(r["arm"], r["seed"]) for r in out["results"]}
    todo = [(arm, seed) for seed in args.seeds for arm in args.arms if (arm, seed) not in done]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is a subprocess
        for future in as_completed([pool.submit(one, arm, seed, args, out) for arm, seed in todo]):
            out["results"].append(future.result())
            write(args, out, t0)
    print(json.dumps(out.get("summary"), indent=2))


if __name__ == "__main__":
    main()
