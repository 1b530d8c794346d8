"""The `harnessrl` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

EPILOG = """commands:
  init      scaffold a project (harness, tasks, grader, config): harnessrl init my_agent
  check     one graded attempt of a config's harness before training: harnessrl check --config C
  train     train a config: harnessrl train --config my_agent/config.yaml [--resume | --fresh]
  inspect   what a run recorded: harnessrl inspect runs/demo [--rollout ID] [--step N]
  export    rows or traces for other tools: harnessrl export runs/demo --format parquet --out rows.parquet
  validate  check an exported file against its schema: harnessrl validate rows.parquet
  export-model  a checkpoint as an HF model folder: harnessrl export-model runs/demo [--step N] --out DIR
  sft       fine-tune on recorded calls (a teacher's run, traces): harnessrl sft --config C --from RUN_DIR|TRACE
  eval      held-out tasks through the harness on any model folder or checkpoint: harnessrl eval --config C --model DIR
  import    a trace file into a new run directory: harnessrl import trace.jsonl --run-dir runs/copy
  dashboard browse a run in the browser: harnessrl dashboard --run runs/demo
  demo      train SmolLM2-135M through the calc harness on this CPU and report before/after
  doctor    what this machine has (Python, torch build, bubblewrap, Chromium, memory, cores) and what is missing
  engine    run the builtin engine server (see: harnessrl engine --help)
  gateway   run the gateway (see: harnessrl gateway --help)
"""

PASSTHROUGH = {
    "engine": ("harnessrl.engine.server", "main"),
    "gateway": ("harnessrl.gateway.__main__", "main"),
    "inspect": ("harnessrl.inspection", "main"),
    "export": ("harnessrl.export.cli", "export_main"),
    "validate": ("harnessrl.export.cli", "validate_main"),
    "export-model": ("harnessrl.trainer.export_model", "main"),
    "eval": ("harnessrl.runs.evaluate", "main"),
    "sft": ("harnessrl.trainer.sft", "main"),
    "import": ("harnessrl.export.cli", "import_main"),
    "dashboard": ("harnessrl.dashboard.cli", "main"),
    "doctor": ("harnessrl.runs.doctor", "main"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `harnessrl` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv and argv[0] in PASSTHROUGH:
        import importlib

        module, fn = PASSTHROUGH[argv[0]]
        return int(getattr(importlib.import_module(module), fn)(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    # SIGTERM ends a command like Ctrl-C: its `finally` blocks stop the engine and gateway it started
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from harnessrl.config import ConfigError, load_config
    from harnessrl.controller.runners.forkserver import ForkServerError
    from harnessrl.runs.rundir import Mode, RunDirError

    try:
        if args.command == "init":
            return _init(args.dir)
        if args.command == "demo":
            from harnessrl.examples import example_config

            path = example_config("calc")
            cfg = load_config(path, args.overrides)
            resume = "harnessrl demo --resume"
            return _run(cfg, Mode.RESUME if args.resume else Mode.REPLACE, not args.no_check, resume)
        cfg = load_config(args.config, args.overrides)
        if args.command == "check":
            return _check(cfg, args.task)
        if cfg.train.algorithm == "sft":
            return _sft(cfg, args.resume, args.fresh)
        mode = Mode.RESUME if args.resume else Mode.FRESH if args.fresh else Mode.NEW
        again = " ".join(["harnessrl train --config", str(args.config), *args.overrides, "--resume"])
        return _run(cfg, mode, not args.no_check, again)
    except (ConfigError, RunDirError, ForkServerError) as e:  # a bad preload: one line, not a traceback
        print(f"harnessrl: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harnessrl", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="scaffold a project: harness, tasks, grader, config")
    init.add_argument("dir", type=Path)
    check = sub.add_parser("check", help="one graded attempt of the harness before training")
    check.add_argument("--config", required=True, type=Path)
    check.add_argument("--task", type=int, default=0, help="index of the training task to try (default 0)")
    check.add_argument("overrides", nargs="*", help="dotted overrides, e.g. engine.model=/path/to/model")
    demo = sub.add_parser("demo", help="the CPU demo (calc example, SmolLM2-135M)")
    demo.add_argument("--resume", action="store_true", help="continue runs/demo instead of starting again")
    demo.add_argument("--no-check", action="store_true", help="skip the preflight attempt")
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4 eval.n_heldout=50")
    train = sub.add_parser("train", help="train a config")
    train.add_argument("--config", required=True, type=Path)
    how = train.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run in run_dir from its checkpoint")
    how.add_argument("--fresh", action="store_true", help="delete the earlier run in run_dir first")
    train.add_argument("--no-check", action="store_true", help="skip the preflight attempt")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4")
    for name in PASSTHROUGH:
        sub.add_parser(name, help=f"see: harnessrl {name} --help")
    return parser


def _init(directory: Path) -> int:
    from harnessrl.runs.scaffold import ScaffoldError, init_project

    try:
        written = init_project(directory)
    except ScaffoldError as e:
        print(f"harnessrl: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(p.name for p in written)} to {directory}")
    print(f"next:  harnessrl check --config {directory / 'config.yaml'}")
    print(f"then:  harnessrl train --config {directory / 'config.yaml'}")
    return 0


def _check(cfg: Any, task: int) -> int:
    from harnessrl.runs.preflight import run_check

    print("harnessrl: starting the engine and gateway for one attempt ...", file=sys.stderr)
    report = run_check(cfg, task)
    print(report.render())
    return 0 if report.ok else 1


def _sft(cfg: Any, resume: bool, fresh: bool) -> int:
    """`harnessrl train` with `train.algorithm: sft`: what `harnessrl sft` runs, on `sft.source`
    (`--resume` continues it from its newest checkpoint)."""
    from harnessrl.config import ConfigError
    from harnessrl.runs.rundir import RunDirError
    from harnessrl.trainer.sft import print_step, render, run_sft
    from harnessrl.trainer.sft_data import SftDataError
    from harnessrl.trainer.trackers import TrackerError

    try:
        print(render(run_sft(cfg, fresh=fresh, resume=resume, on_step=print_step)))
    except (ConfigError, SftDataError, RunDirError, TrackerError) as e:
        print(f"harnessrl: {e}", file=sys.stderr)
        return 2
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: services and harnesses are stopped


def _run(cfg: Any, mode: Any, check: bool, resume_command: str) -> int:
    from tqdm import tqdm

    from harnessrl.runs.flow import CheckFailed, run

    bars: dict[str, Any] = {}

    def progress(label: str, done: int, total: int) -> None:
        bar = bars.get(label)
        if bar is None:
            unit = "batch" if label.startswith("update") else "rollout"
            bar = bars[label] = tqdm(total=total, desc=label, unit=unit, leave=False, file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def notify(message: str) -> None:
        tqdm.write(f"harnessrl: {message}", file=sys.stderr)

    run_dir = Path(cfg.run_dir).resolve()
    print(f"harnessrl: run directory {run_dir} (logs in harnessrl.log, logs/)", file=sys.stderr)
    try:
        summary = run(cfg, mode=mode, check=check, progress=progress, on_step=_step_printer(cfg, notify),
                      notify=notify)  # fmt: skip
    except KeyboardInterrupt:
        for bar in bars.values():
            bar.close()
        print(f"\nharnessrl: interrupted. Nothing recorded is lost; continue with:\n  {resume_command}",
              file=sys.stderr)  # fmt: skip
        return 130
    except CheckFailed as e:
        print(f"harnessrl: the preflight attempt failed, so training did not start:\n{e}", file=sys.stderr)
        print("fix the harness or grader (harnessrl check --config ... runs this alone), or pass --no-check",
              file=sys.stderr)  # fmt: skip
        return 1
    _print_summary(summary, run_dir, resume_command)
    return 0


def _step_printer(cfg: Any, notify: Any) -> Any:
    from tqdm import tqdm

    def on_step(step: int, m: dict[str, Any]) -> None:
        rate, reward = m.get("merge_rate"), m.get("reward")
        tqdm.write(
            f"step {step:3d}/{cfg.train.steps}  reward {'n/a' if reward is None else f'{reward:.3f}'}  "
            f"loss {m['loss']:+.4e}  tokens {m['trainable_tokens']:5d}  "
            f"rows/rollout {m['rows_per_rollout']:.2f}  merge {'n/a' if rate is None else f'{rate:.2f}'}  "
            f"time {m['time_rollout_s'] + m['time_update_s'] + m['time_weight_sync_s']:.0f}s",
            file=sys.stderr,
        )
        run_dir = Path(cfg.run_dir).resolve()
        if m.get("rollouts_grader_error"):
            notify(f"step {step}: the grader failed on {m['rollouts_grader_error']} rollouts (not scored, not "
                   f"trained on): {m.get('first_error')}; see {run_dir}/rollouts/*/attempt-*/grader_error.txt")  # fmt: skip
        if m.get("rollouts_flagged_hacking"):
            notify(f"step {step}: the grader flagged {m['rollouts_flagged_hacking']} rollouts as gaming the reward "
                   f"(details['hacking']); read them with harnessrl inspect {run_dir} --step {step}")  # fmt: skip
        if m.get("rollouts_infra_error"):
            notify(f"step {step}: {m['rollouts_infra_error']} rollouts could not run: {m.get('first_error')}")
        if m.get("rollouts_timed_out"):
            notify(f"step {step}: {m['rollouts_timed_out']} harnesses ran past controller.harness_timeout_s and "
                   "were graded as they stood")  # fmt: skip
        if m["rollouts"] and not m["calls"]:
            notify(f"no rollout of step {step} made a model call; is the harness failing before its first "
                   f"call? Its output: {run_dir}/rollouts/*/attempt-*/stderr.txt")  # fmt: skip

    return on_step


def _print_summary(s: dict[str, Any], run_dir: Path, resume_command: str) -> None:
    from harnessrl.runs.summary import stop_note

    def cell(r: dict[str, Any] | None) -> str:
        if r is None or r["mean"] is None:  # eval.before off, or no task could be graded
            return "n/a"
        lo, hi = r["ci95"]
        return f"{r['mean']:.3f} [{lo:.2f}, {hi:.2f}]"

    rate = s.get("merge_rate")
    note = stop_note(s, resume_command)  # train.time_budget_s stopped the run: where, how to go on
    if s.get("heldout_reward_after") is None:
        print(f"\nno held-out reward could be measured; see {run_dir / 'harnessrl.log'}")
        if note is not None:
            print(note)
        print(f"summary: {run_dir / 'summary.json'}")
        return
    print()
    print(f"held-out reward on {s['n_heldout']} tasks (95% interval)")
    print(f"{'eval temperature':<18}{'before':>22}{'after':>22}")
    for t, r in s["heldout_by_temperature"].items():
        print(f"{t:<18}{cell(r['before']):>22}{cell(r['after']):>22}")
    print(
        f"train_steps={s['train_steps']}  wall={s['wall_seconds']:.0f}s  "
        f"merge_rate={'n/a' if rate is None else f'{rate:.3f}'}  rows/rollout={s['rows_per_rollout'] or 0:.2f}"
    )
    if note is not None:
        print(note)
    print(f"summary: {run_dir / 'summary.json'}")
    print(f"reward curve: {run_dir / 'reward_curve.png'}")


if __name__ == "__main__":
    sys.exit(main())
