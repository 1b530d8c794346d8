"""`harnessrl eval --config C --model DIR`: a config's held-out tasks through its harness on any model
folder or checkpoint, without training, reported as a run reports its before/after. A team compares its
base model, a checkpoint and an exported model on its own harness with the same numbers.

    harnessrl eval --config my_agent/config.yaml --model runs/my_agent/checkpoints/step-4
    harnessrl eval --config C --model path/to/Qwen3-0.6B eval.n_heldout=50 --out base.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.config import ConfigError, RunConfig, check_model, load_config
from harnessrl.controller import Controller
from harnessrl.controller.factory import make_runner
from harnessrl.modeling.loading import resolve_model
from harnessrl.runs.context import connect
from harnessrl.runs.project import resolve_project
from harnessrl.runs.rundir import Mode, prepare
from harnessrl.services.stack import start_services
from harnessrl.trainer.loop import EvalResult, Progress, evaluate


@dataclass
class EvalContext:
    """What `trainer.loop.evaluate` needs of a run: its id, controller, progress and notices."""

    run_id: str
    controller: Controller
    progress: Progress
    notify: Callable[[str], None]


def evaluate_model(
    cfg: RunConfig, model: str, progress: Progress | None = None, notify: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Held-out reward of `model` (a folder, a checkpoint, or a named model) on `cfg`'s harness at each
    eval temperature; the engine and gateway are started for it in a scratch directory (kept: its path
    is in the result) and stopped."""
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"model": model})})
    check_model(cfg)
    project = resolve_project(cfg)
    _, heldout = project.splits(cfg)
    if not heldout:
        raise ConfigError("the task source gave no held-out tasks (tasks.heldout or eval.n_heldout)")
    runner = make_runner(cfg.controller, project.harness_spec(cfg.controller.harness_timeout_s))
    scratch = Path(tempfile.mkdtemp(prefix="harnessrl-eval-"))
    prepare(scratch, cfg, Mode.NEW)  # a run directory (run.json, config.json): `harnessrl inspect` reads it
    stack = start_services(cfg, scratch, resolve_model(model), secrets.token_hex(16), notify)

    async def go() -> list[EvalResult]:
        parts = connect(cfg, scratch, project, stack, runner)
        ctx = EvalContext(
            parts.run_id, parts.controller, progress or (lambda *_: None), notify or (lambda m: None)
        )
        try:
            await parts.start()
            temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
            return [await evaluate(ctx, heldout, f"eval-t{t:g}", t) for t in temps]
        finally:
            await parts.aclose()

    try:
        results = asyncio.run(go())
    finally:
        stack.stop()
    temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
    return {"model": model, "name": cfg.name, "n_heldout": len(heldout), "work_dir": str(scratch),
            "heldout_by_temperature": {f"{t:g}": r.as_dict() for t, r in zip(temps, results, strict=True)}}  # fmt: skip


def render(result: dict[str, Any]) -> str:
    """The report: one line per eval temperature, as a run's before/after reports it."""
    lines = [f"eval: {result['model']} on {result['name'] or 'the config'}'s held-out tasks"]
    for t, r in result["heldout_by_temperature"].items():
        lo, hi = r["ci95"]
        lines.append(f"  held-out reward at T={t}: {r['mean']:.3f}  (95% CI {lo:.3f}-{hi:.3f}, n={r['n']}, "
                     f"failed {r['failed']}, timed out {r['timed_out']})")  # fmt: skip
    lines.append(f"  rollouts and logs: {result['work_dir']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Entry point of `harnessrl eval`."""
    p = argparse.ArgumentParser(prog="harnessrl eval", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--model", required=True, help="a model folder, a checkpoint (step-N), or a named model")
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.n_heldout=50")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        result = evaluate_model(cfg, args.model, notify=lambda m: print(f"harnessrl: {m}", file=sys.stderr))
    except (ConfigError, ValueError) as e:
        print(f"harnessrl eval: {e}", file=sys.stderr)
        return 2
    print(render(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
