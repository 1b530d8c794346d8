"""One full run: start engine and gateway, evaluate, train (sync schedule), evaluate, summarise.

`harnessrl demo` is this with the `calc` example's config; `harnessrl train --config` runs any config.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harnessrl.config import RunConfig
from harnessrl.controller import Controller, HarnessSpec
from harnessrl.examples import ExampleSpec, get_example, write_tasks
from harnessrl.gateway.client import ControlClient
from harnessrl.modeling.loading import load_model, resolve_model
from harnessrl.modeling.packed import use_onednn_for_training
from harnessrl.schema import Task
from harnessrl.services import Service, free_port, start_engine, start_gateway
from harnessrl.trainer.async_loop import run_async
from harnessrl.trainer.loop import EvalResult, TrainContext, evaluate, run_sync
from harnessrl.trainer.metrics import MetricsLogger
from harnessrl.trainer.ppo import lr_lambda

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def setup_logging(run_dir: Path) -> None:
    """Log everything to `<run_dir>/harnessrl.log`; the console shows only progress and results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "harnessrl.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_id_for(run_dir: Path) -> str:
    """A stable id per run directory: rollout client ids derive from it, so a resumed run reuses work."""
    path = run_dir / "run.json"
    if path.exists():
        return str(json.loads(path.read_text())["run_id"])
    run_id = "run" + secrets.token_hex(4)
    path.write_text(json.dumps({"run_id": run_id}))
    return run_id


def start_services(
    cfg: RunConfig, run_dir: Path, model_dir: Path, admin_key: str
) -> tuple[Service | None, Service, str]:
    """Start the builtin engine (unless an external one is configured) and the gateway; wait until
    both answer. Returns (engine process or None, gateway process, engine URL)."""
    engine: Service | None = None
    if cfg.engine.kind == "builtin":
        engine_port = cfg.engine.port or free_port()
        engine = start_engine(model_dir, engine_port, run_dir / "logs", cfg.engine.max_batch,
                              cfg.engine.max_model_len, cfg.engine.threads, cfg.engine.device,
                              cfg.engine.dtype, cfg.engine.matmul)  # fmt: skip
        engine_url = engine.url
    else:
        engine_url = str(cfg.engine.url)
    mode = "tito" if cfg.engine.kind == "sglang" else cfg.gateway.mode  # SGLang returns ids only to tito
    gateway_port = cfg.gateway.port or free_port()
    gateway = start_gateway(
        run_dir / "store.sqlite", engine_url, gateway_port, admin_key, run_dir / "logs",
        cfg.gateway.default_max_tokens, mode=mode, tokenizer=model_dir if mode == "tito" else None,
        upstream_kind="sglang" if cfg.engine.kind == "sglang" else "openai",
    )  # fmt: skip
    try:
        if engine is not None:
            engine.wait_healthy()
        gateway.wait_healthy()
    except BaseException:
        gateway.stop()
        if engine is not None:
            engine.stop()
        raise
    return engine, gateway, engine_url


def run(
    cfg: RunConfig,
    fresh: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the whole loop for `cfg`; returns the summary (also written to `<run_dir>/summary.json`)."""
    started = time.time()
    run_dir = Path(cfg.run_dir).resolve()
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    setup_logging(run_dir)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    example = get_example(cfg.example)
    train_tasks, heldout = example.build_splits(cfg.data.n_train, cfg.eval.n_heldout, cfg.data.seed)
    write_tasks(train_tasks, run_dir / "data" / "train.jsonl")
    write_tasks(heldout, run_dir / "data" / "heldout.jsonl")
    model_dir = resolve_model(cfg.engine.model)
    admin_key = secrets.token_hex(16)
    engine, gateway, engine_url = start_services(cfg, run_dir, model_dir, admin_key)
    try:
        summary = asyncio.run(
            _run_async(
                cfg,
                run_dir,
                example,
                model_dir,
                gateway.url,
                engine_url,
                admin_key,
                train_tasks,
                heldout,
                progress or (lambda *_: None),
                on_step,
            )
        )
    finally:
        gateway.stop()
        if engine is not None:
            engine.stop()
    summary["wall_seconds"] = time.time() - started
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from harnessrl.plot import reward_curve

    reward_curve(run_dir / "metrics.jsonl", summary, run_dir / "reward_curve.png")
    return summary


async def _run_async(
    cfg: RunConfig,
    run_dir: Path,
    example: ExampleSpec,
    model_dir: Path,
    gateway_url: str,
    engine_url: str,
    admin_key: str,
    train_tasks: list[Task],
    heldout: list[Task],
    progress: Progress,
    on_step: Callable[[int, dict[str, Any]], None] | None,
) -> dict[str, Any]:
    from harnessrl.trainer.weights import engine_admin

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    client = ControlClient(gateway_url, admin_key)
    engine = engine_admin(cfg.engine.kind, engine_url)
    harness = HarnessSpec(command=example.harness_command, timeout_s=cfg.controller.harness_timeout_s)
    runner = cfg.controller.runner()
    controller = Controller(
        client, gateway_url, harness, example.grader, run_dir,
        concurrency=cfg.controller.concurrency,
        max_attempts=cfg.controller.max_attempts,
        grader_timeout_s=cfg.controller.grader_timeout_s,
        grader_retries=cfg.controller.grader_retries,
        runner=runner,
    )  # fmt: skip
    model = load_model(model_dir, device=cfg.train.device)
    log.info(
        "event=trainer_matmul path=%r",
        use_onednn_for_training(model, cfg.train.matmul, model.lm_head.weight.device),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    tc = cfg.train
    schedule = lr_lambda(tc.lr_schedule, tc.warmup_steps, tc.steps, tc.min_lr_ratio)
    metrics = MetricsLogger(run_dir)
    ctx = TrainContext(
        cfg, run_id_for(run_dir), run_dir, client, controller, engine, model, optimizer, metrics, progress,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        ref_model=load_model(model_dir, device=tc.device).requires_grad_(False) if tc.kl_coef > 0 else None,
        heldout=heldout,
    )  # fmt: skip
    train = run_async if tc.schedule == "async" else run_sync
    try:
        if hasattr(runner, "start"):
            await runner.start()  # a fork server that cannot preload fails the run here, not per attempt
        temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
        before = [await evaluate(ctx, heldout, f"eval-before-t{t:g}", t) for t in temps]
        t_train = time.time()
        steps = await train(ctx, train_tasks, on_step)
        train_wall = time.time() - t_train - ctx.eval_seconds
        after = [await evaluate(ctx, heldout, f"eval-after-{steps}-t{t:g}", t) for t in temps]
    finally:
        metrics.close()
        await client.aclose()
        await engine.aclose()
        if hasattr(runner, "close"):
            runner.close()
    summary = summarise(cfg, before, after, steps, metrics.read())
    summary["train_wall_seconds"] = train_wall
    summary["eval_during_train_seconds"] = ctx.eval_seconds
    return summary


def summarise(
    cfg: RunConfig,
    before_all: list[EvalResult],
    after_all: list[EvalResult],
    steps: int,
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's summary: held-out reward before/after with intervals, merge statistics, timings."""
    before, after = before_all[0], after_all[0]
    temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
    by_temp = {
        f"{t:g}": {"before": b.as_dict(), "after": a.as_dict()}
        for t, b, a in zip(temps, before_all, after_all, strict=True)
    }
    multi = sum(r.get("calls", 0) > r.get("rollouts", 0) for r in records)
    rates = [r["merge_rate"] for r in records if r.get("merge_rate") is not None]
    return {
        "example": cfg.example,
        "model": cfg.engine.model,
        "heldout_reward_before": before.mean,
        "heldout_reward_after": after.mean,
        "heldout_ci95_before": [before.lo, before.hi],
        "heldout_ci95_after": [after.lo, after.hi],
        "n_heldout": before.n,
        "eval_temperature": cfg.eval.temperature,
        "heldout_by_temperature": by_temp,
        # (step, held-out reward at eval.temperature): before, every `eval.every` steps, after
        "heldout_curve": [
            [0, before.mean],
            *([r["step"], r["heldout_reward"]] for r in records if "heldout_reward" in r),
            [steps, after.mean],
        ],
        "train_steps": steps,
        "rollouts_per_step": cfg.train.batch_groups * cfg.train.group_size,
        "merge_rate": sum(rates) / len(rates) if rates else None,
        "merge_breaks": _sum_counts([r.get("breaks", {}) for r in records]),
        "steps_with_multi_call_rollouts": multi,
        "rows_per_rollout": _mean([r["rows_per_rollout"] for r in records if "rows_per_rollout" in r]),
        "train_reward_first": records[0]["reward"] if records else None,
        "train_reward_last": records[-1]["reward"] if records else None,
        "schedule": cfg.train.schedule,
        "mean_step_seconds": _mean([r["time_step_s"] for r in records if "time_step_s" in r]),
    }


def _sum_counts(counts: list[dict[str, int]]) -> dict[str, int]:
    """Per-cause totals over the run's steps: the run's merge report."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + int(v)
    return total


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
