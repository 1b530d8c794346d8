"""The `harnessrl` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

EPILOG = """commands:
  demo      train SmolLM2-135M through the calc harness on this CPU and report before/after
  train     run any config: harnessrl train --config examples/calc/config.yaml train.steps=4
  engine    run the builtin engine server (see: harnessrl engine --help)
  gateway   run the gateway (see: harnessrl gateway --help)
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `harnessrl` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv and argv[0] == "engine":
        from harnessrl.engine.server import main as engine_main

        return int(engine_main(argv[1:]) or 0)
    if argv and argv[0] == "gateway":
        from harnessrl.gateway.__main__ import main as gateway_main

        return gateway_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="harnessrl", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the CPU demo (calc example, SmolLM2-135M)")
    demo.add_argument(
        "--resume", action="store_true", help="continue the run in run_dir instead of starting fresh"
    )
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4 eval.n_heldout=50")
    train = sub.add_parser("train", help="run a config")
    train.add_argument("--config", required=True, type=Path)
    train.add_argument("--fresh", action="store_true", help="delete run_dir first")
    train.add_argument("overrides", nargs="*")
    sub.add_parser("engine", help="run the builtin engine")
    sub.add_parser("gateway", help="run the gateway")
    args = parser.parse_args(argv)
    # SIGTERM ends a run like Ctrl-C: its `finally` blocks stop the engine and gateway it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from harnessrl.config import ConfigError, load_config

    try:
        if args.command == "demo":
            from harnessrl.examples import get_example

            cfg = load_config(get_example("calc").config_path, args.overrides)
            return _run(cfg, fresh=not args.resume)
        cfg = load_config(args.config, args.overrides)
        return _run(cfg, fresh=args.fresh)
    except ConfigError as e:
        print(f"harnessrl: {e}", file=sys.stderr)
        return 2


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: services and harnesses are stopped


def _run(cfg: Any, fresh: bool) -> int:
    from tqdm import tqdm

    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    from harnessrl.run import run

    bars: dict[str, Any] = {}

    def progress(label: str, done: int, total: int) -> None:
        bar = bars.get(label)
        if bar is None:
            bar = bars[label] = tqdm(total=total, desc=label, unit="rollout", leave=False, file=sys.stderr)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def on_step(step: int, m: dict[str, Any]) -> None:
        rate = m.get("merge_rate")
        rate_s = "n/a" if rate is None else f"{rate:.2f}"
        tqdm.write(
            f"step {step:3d}/{cfg.train.steps}  reward {m['reward']:.3f}  loss {m['loss']:+.4f}  "
            f"tokens {m['trainable_tokens']:5d}  rows/rollout {m['rows_per_rollout']:.2f}  merge {rate_s}  "
            f"time {m['time_rollout_s'] + m['time_update_s'] + m['time_weight_sync_s']:.0f}s",
            file=sys.stderr,
        )
        if m["rollouts"] and not m["calls"]:
            tqdm.write(
                f"warning: no rollout of step {step} made a model call; is the harness failing before its "
                f"first call? Its output: {Path(cfg.run_dir).resolve()}/rollouts/*/attempt-*/stderr.txt",
                file=sys.stderr,
            )

    print(
        f"harnessrl: run directory {Path(cfg.run_dir).resolve()} (logs in harnessrl.log, logs/)",
        file=sys.stderr,
    )
    summary = run(cfg, fresh=fresh, progress=progress, on_step=on_step)
    _print_summary(summary, Path(cfg.run_dir).resolve())
    return 0


def _print_summary(s: dict[str, Any], run_dir: Path) -> None:
    def cell(r: dict[str, Any]) -> str:
        lo, hi = r["ci95"]
        return f"{r['mean']:.3f} [{lo:.2f}, {hi:.2f}]"

    rate = s.get("merge_rate")
    print()
    print(f"held-out reward on {s['n_heldout']} tasks (95% interval)")
    print(f"{'eval temperature':<18}{'before':>22}{'after':>22}")
    for t, r in s["heldout_by_temperature"].items():
        print(f"{t:<18}{cell(r['before']):>22}{cell(r['after']):>22}")
    print(
        f"train_steps={s['train_steps']}  wall={s['wall_seconds']:.0f}s  "
        f"merge_rate={'n/a' if rate is None else f'{rate:.3f}'}  rows/rollout={s['rows_per_rollout'] or 0:.2f}"
    )
    print(f"summary: {run_dir / 'summary.json'}")
    print(f"reward curve: {run_dir / 'reward_curve.png'}")


if __name__ == "__main__":
    sys.exit(main())
