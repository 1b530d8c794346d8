"""One full run: start engine and gateway, check, evaluate, train, evaluate, summarise.

`harnessrl demo` is this with the `calc` example's config; `harnessrl train --config` runs any config;
`harnessrl.train(...)` (harnessrl/api.py) is the same from Python.

    run(cfg):
        prepare the run directory, write the task splits, start the services (ServiceStack)
        connect: control client, engine admin, runner, controller (RunParts)
        preflight: one graded attempt (CheckFailed stops the run)
        build_trainer: model, optimizer, metrics (TrainContext)
        evaluate before → train (sync or async schedule) → evaluate after
        stop the services; write summary.json, reward_curve.png and the rollout index
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harnessrl.config import RunConfig, check_model
from harnessrl.controller.factory import make_runner
from harnessrl.controller.isolation import protect_run_dir
from harnessrl.controller.runner import Runner
from harnessrl.examples import write_tasks
from harnessrl.modeling.loading import resolve_model
from harnessrl.runs.context import RunParts, build_trainer, connect
from harnessrl.runs.preflight import CheckReport, preflight
from harnessrl.runs.project import Project, resolve_project
from harnessrl.runs.rundir import Mode, prepare
from harnessrl.runs.summary import summarise, write_index, write_summary
from harnessrl.schema import Task
from harnessrl.services.stack import ServiceStack, external_admin_key, run_engine_key, start_services
from harnessrl.trainer.async_loop import run_async
from harnessrl.trainer.checkpoint import latest_checkpoint
from harnessrl.trainer.loop import EvalResult, Progress, TrainContext, evaluate, run_sync
from harnessrl.trainer.teacher import refuse_other_tokenizer

log = logging.getLogger(__name__)

OnStep = Callable[[int, dict[str, Any]], None]


class CheckFailed(RuntimeError):
    """The preflight attempt showed the run cannot train; `report` says why."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.render())
        self.report = report


@contextlib.contextmanager
def run_log(run_dir: Path) -> Iterator[None]:
    """Log harnessrl's records to `<run_dir>/harnessrl.log` for the run's duration; the console shows
    only progress and results. Only the `harnessrl` logger gets the handler: the logging of a program
    that embeds a run (a notebook, a script with its own handlers) is left as it was."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "harnessrl.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger("harnessrl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


@dataclass
class RunInputs:
    """What a run trains on and with, once its directory is prepared."""

    cfg: RunConfig
    run_dir: Path
    project: Project
    model_dir: Path
    train_tasks: list[Task]
    heldout: list[Task]
    runner: Runner | None = None  # starts the harness (made before the services, see `run`)


def run(
    cfg: RunConfig,
    fresh: bool = False,
    progress: Progress | None = None,
    on_step: OnStep | None = None,
    *,
    resume: bool = False,
    mode: Mode | None = None,
    check: bool = True,
    notify: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the whole loop for `cfg`; returns the summary (also written to `<run_dir>/summary.json`).

    The run directory is used as `mode` says (default: `fresh` → FRESH, `resume` → RESUME, else NEW;
    see `harnessrl.runs.rundir`). With `check`, one graded attempt runs first and a failing one stops
    the run (`CheckFailed`) before any evaluation or training."""
    if cfg.train.algorithm != "rl":
        raise ValueError(
            "train.algorithm: sft is run by harnessrl.trainer.sft.run_sft (harnessrl train does)"
        )
    started = time.time()
    run_dir = Path(cfg.run_dir).resolve()
    mode = mode or (Mode.FRESH if fresh else Mode.RESUME if resume else Mode.NEW)
    say = notify or (lambda message: None)
    check_model(cfg)
    refuse_other_tokenizer(cfg)  # a teacher must score the student's own token IDs
    project = resolve_project(cfg)  # a config error surfaces before the run directory is touched
    admin_key = external_admin_key(cfg) or secrets.token_hex(16)
    run_engine_key(cfg)  # gateway.urls without the engine key they use: refused here, before any service
    for notice in prepare(run_dir, cfg, mode):
        (notify or log.info)(notice)
    with run_log(run_dir):
        inputs = _inputs(cfg, run_dir, project)
        # before any service starts: a harness the sandbox cannot start is refused here
        inputs.runner = make_runner(cfg.controller, project.harness_spec(cfg.controller.harness_timeout_s))
        stack = start_services(cfg, run_dir, inputs.model_dir, admin_key, notify)
        protect_run_dir(run_dir)  # the store (key secret), logs and references: not for the harness's uid
        try:
            summary = asyncio.run(
                _train_and_evaluate(inputs, stack, progress or (lambda *_: None), on_step, check, say)
            )
        finally:
            stack.stop()
            write_index(run_dir)
        summary["wall_seconds"] = time.time() - started
        return write_summary(run_dir, summary)


def _inputs(cfg: RunConfig, run_dir: Path, project: Project) -> RunInputs:
    """The task splits (written to `<run_dir>/data/`) and the model folder."""
    train_tasks, heldout = project.splits(cfg)
    write_tasks(train_tasks, run_dir / "data" / "train.jsonl")
    write_tasks(heldout, run_dir / "data" / "heldout.jsonl")
    if not train_tasks or not heldout:
        raise ValueError(
            f"the task source gave {len(train_tasks)} training and {len(heldout)} held-out tasks"
        )
    return RunInputs(cfg, run_dir, project, resolve_model(cfg.engine.model), train_tasks, heldout)


async def _train_and_evaluate(
    inputs: RunInputs,
    stack: ServiceStack,
    progress: Progress,
    on_step: OnStep | None,
    check: bool,
    notify: Callable[[str], None],
) -> dict[str, Any]:
    """Preflight, then held-out evaluation before and after training; returns the summary."""
    cfg, run_dir = inputs.cfg, inputs.run_dir
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    assert inputs.runner is not None
    parts = connect(cfg, run_dir, inputs.project, stack, inputs.runner)
    try:
        await parts.start()
        if check:
            await _preflight(parts, inputs.train_tasks[0], run_dir)
        ctx = build_trainer(cfg, run_dir, inputs.model_dir, parts, inputs.heldout, progress, notify)
        try:
            before, after, steps, train_wall = await _evaluate_train_evaluate(ctx, inputs, on_step)
        finally:
            ctx.metrics.close()
            if ctx.teacher is not None:
                await ctx.teacher.aclose()
            if ctx.data_parallel is not None:
                ctx.data_parallel.close()
    finally:
        await parts.aclose()
    summary = summarise(cfg, before, after, steps, ctx.metrics.read())
    summary["train_wall_seconds"] = train_wall
    summary["eval_during_train_seconds"] = ctx.eval_seconds
    summary["run_dir"] = str(run_dir)
    newest = latest_checkpoint(run_dir / "checkpoints")
    summary["checkpoint"] = str(newest) if newest is not None else None
    summary.update(parts.engine.sync_report())
    return summary


async def _preflight(parts: RunParts, task: Task, run_dir: Path) -> None:
    """One graded attempt before any training; a failing one stops the run."""
    report = await preflight(parts.controller, parts.client, task, parts.run_id, run_dir)
    log.info("event=preflight ok=%s report=%r", report.ok, report.render())
    if not report.ok:
        raise CheckFailed(report)


async def _evaluate_train_evaluate(
    ctx: TrainContext, inputs: RunInputs, on_step: OnStep | None
) -> tuple[list[EvalResult], list[EvalResult], int, float]:
    """Held-out evaluation at each eval temperature (unless `eval.before` is off: `before` is then
    empty), training, evaluation again; returns (before, after, steps trained, training wall seconds
    without the evaluations during training)."""
    cfg = inputs.cfg
    train = run_async if cfg.train.schedule == "async" else run_sync
    temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
    before = [await evaluate(ctx, inputs.heldout, f"eval-before-t{t:g}", t) for t in temps if cfg.eval.before]
    t_train = time.time()
    steps = await train(ctx, inputs.train_tasks, on_step)
    train_wall = time.time() - t_train - ctx.eval_seconds
    after = [await evaluate(ctx, inputs.heldout, f"eval-after-{steps}-t{t:g}", t) for t in temps]
    return before, after, steps, train_wall
