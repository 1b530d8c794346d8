"""One full run: start engine and gateway, check, evaluate, train, evaluate, summarise.

`harnessrl demo` is this with the `calc` example's config; `harnessrl train --config` runs any config;
`harnessrl.train(...)` (harnessrl/api.py) is the same from Python.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harnessrl.check import CheckReport, preflight
from harnessrl.config import RunConfig, check_model
from harnessrl.controller import Controller
from harnessrl.controller.factory import make_runner
from harnessrl.controller.isolation import protect_run_dir
from harnessrl.errors import ConfigError
from harnessrl.examples import write_tasks
from harnessrl.gateway.client import Control, ControlClient
from harnessrl.gateway.replicas import GatewayReplicas
from harnessrl.modeling.loading import load_model, resolve_model
from harnessrl.modeling.lora import attach_lora, reference_model
from harnessrl.modeling.packed import use_onednn_for_training
from harnessrl.project import Project, resolve_project
from harnessrl.rundir import Mode, prepare
from harnessrl.rundir import run_id as run_id_of
from harnessrl.schema import Task
from harnessrl.services import Service, free_port, start_engine, start_gateway
from harnessrl.trainer.async_loop import run_async
from harnessrl.trainer.loop import EvalResult, TrainContext, evaluate, run_sync
from harnessrl.trainer.metrics import MetricsLogger, finite_json
from harnessrl.trainer.ppo import lr_lambda
from harnessrl.trainer.trackers import make_trackers
from harnessrl.vllm_server import ManagedVLLM, VLLMSettings, find_vllm_python, untied_model_dir

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


def start_services(
    cfg: RunConfig,
    run_dir: Path,
    model_dir: Path,
    admin_key: str,
    notify: Callable[[str], None] | None = None,
) -> tuple[Service | ManagedVLLM | None, list[Service], str]:
    """Start the engine (the builtin one, or vLLM when `engine.kind=vllm` names no URL; an external one
    is only used) and the gateway (`gateway.replicas` processes); wait until all answer. Returns (engine
    process or None, gateway processes, engine URL)."""
    engine: Service | ManagedVLLM | None = None
    if cfg.engine.kind == "builtin":
        engine_port = cfg.engine.port or free_port()
        engine = start_engine(model_dir, engine_port, run_dir / "logs", cfg.engine.max_batch,
                              cfg.engine.max_model_len, cfg.engine.threads, cfg.engine.device,
                              cfg.engine.dtype, cfg.engine.matmul)  # fmt: skip
        engine_url = engine.url
    elif cfg.engine.kind == "vllm" and not cfg.engine.url:
        engine = managed_vllm(cfg, run_dir, model_dir)
        engine.start()
        engine_url = engine.url
    else:
        engine_url = str(cfg.engine.url)
    mode = gateway_mode(cfg)
    gateways = []
    for r in range(
        0 if cfg.gateway.urls else cfg.gateway.replicas
    ):  # replicas > 1 only on a PostgreSQL store (RunConfig checks)
        port = (cfg.gateway.port + r if cfg.gateway.port else 0) or free_port()
        gateways.append(start_gateway(
            cfg.store or run_dir / "store.sqlite", engine_url, port, admin_key, run_dir / "logs",
            cfg.gateway.default_max_tokens, mode=mode, tokenizer=model_dir if mode == "tito" else None,
            upstream_kind="sglang" if cfg.engine.kind == "sglang" else "openai",
            name="gateway" if r == 0 else f"gateway{r}", rollout_cache_size=cfg.gateway.rollout_cache_size,
        ))  # fmt: skip
    try:
        if isinstance(engine, ManagedVLLM):
            say = notify or log.info
            say(f"starting vLLM (log: {engine.log_path}); its warm-up takes minutes on a small CPU")
            waited = engine.wait_healthy(
                cfg.engine.vllm_start_timeout_s, progress=lambda s: say(f"waiting for vLLM: {s:.0f}s")
            )
            say(f"vLLM ready after {waited:.0f}s")
        elif engine is not None:
            engine.wait_healthy()
        for gateway in gateways:
            gateway.wait_healthy()
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        if engine is not None:
            engine.stop()
        raise
    return engine, gateways, engine_url


def external_admin_key(cfg: RunConfig) -> str | None:
    """The admin key of gateways the run did not start (`gateway.urls`): $HARNESSRL_ADMIN_KEY."""
    if not cfg.gateway.urls:
        return None
    key = os.environ.get("HARNESSRL_ADMIN_KEY", "")
    if len(key) < 8:
        raise ConfigError(
            "gateway.urls: set HARNESSRL_ADMIN_KEY to the admin key those gateways were started with"
        )
    return key


def gateway_mode(cfg: RunConfig) -> str:
    """The gateway's mode for this engine: tito for SGLang (it returns token IDs only to token-ID
    prompts) and, unless `gateway.mode` is set, for vLLM: vLLM renders chats with the model's own
    template, which for SmolLM2 has no tools, so tool-calling harnesses need the gateway's rendering
    (the one the builtin engine uses) and its tool-call parsing."""
    if cfg.engine.kind == "sglang":
        return "tito"
    if cfg.engine.kind == "vllm" and "mode" not in cfg.gateway.model_fields_set:
        return "tito"
    return cfg.gateway.mode


def managed_vllm(cfg: RunConfig, run_dir: Path, model_dir: Path) -> ManagedVLLM:
    """The vLLM server of a run (not started): the untied view of `model_dir` under `<run_dir>/vllm/`,
    its log in `<run_dir>/logs/vllm.log`."""
    e = cfg.engine
    settings = VLLMSettings(
        python=find_vllm_python(e.vllm_python), dtype=e.dtype, max_model_len=e.max_model_len,
        max_num_seqs=e.max_batch, threads=e.threads, device=e.device, kv_cache_gb=e.vllm_kv_cache_gb,
        enforce_eager=e.vllm_enforce_eager, seed=cfg.train.seed, extra_args=list(e.vllm_args),
    )  # fmt: skip
    served = untied_model_dir(model_dir, run_dir / "vllm" / "model")
    vllm = ManagedVLLM(settings, served, e.port or free_port(), run_dir / "logs")
    vllm.tokenizer_dir = model_dir
    return vllm


def vllm_restarter(vllm: ManagedVLLM, run_dir: Path) -> Callable[[Path], Awaitable[float]]:
    """The restart-on-new-weights sync of a managed vLLM: serve the untied view of the weights at the
    given path (`<run_dir>/vllm/model`, replaced each time)."""

    async def restart(path: Path) -> float:
        served = await asyncio.to_thread(
            untied_model_dir, path, run_dir / "vllm" / "model", vllm.tokenizer_dir
        )
        return await vllm.arestart(served)

    return restart


class CheckFailed(RuntimeError):
    """The preflight attempt showed the run cannot train; `report` says why."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.render())
        self.report = report


def run(
    cfg: RunConfig,
    fresh: bool = False,
    progress: Progress | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    *,
    resume: bool = False,
    mode: Mode | None = None,
    check: bool = True,
    notify: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the whole loop for `cfg`; returns the summary (also written to `<run_dir>/summary.json`).

    The run directory is used as `mode` says (default: `fresh` → FRESH, `resume` → RESUME, else NEW;
    see `harnessrl.rundir`). With `check`, one graded attempt runs first and a failing one stops the
    run (`CheckFailed`) before any evaluation or training."""
    started = time.time()
    run_dir = Path(cfg.run_dir).resolve()
    mode = mode or (Mode.FRESH if fresh else Mode.RESUME if resume else Mode.NEW)
    check_model(cfg)
    project = resolve_project(cfg)  # a config error surfaces before the run directory is touched
    admin_key = external_admin_key(cfg) or secrets.token_hex(16)
    for notice in prepare(run_dir, cfg, mode):
        (notify or log.info)(notice)
    setup_logging(run_dir)
    train_tasks, heldout = project.splits(cfg)
    write_tasks(train_tasks, run_dir / "data" / "train.jsonl")
    write_tasks(heldout, run_dir / "data" / "heldout.jsonl")
    if not train_tasks or not heldout:
        raise ValueError(
            f"the task source gave {len(train_tasks)} training and {len(heldout)} held-out tasks"
        )
    model_dir = resolve_model(cfg.engine.model)
    engine, gateways, engine_url = start_services(cfg, run_dir, model_dir, admin_key, notify)
    protect_run_dir(run_dir)  # the store (key secret), logs and references: not for the harness's uid
    services = Services(
        cfg.gateway.urls or [g.url for g in gateways], engine_url, admin_key,
        engine if isinstance(engine, ManagedVLLM) else None,
    )  # fmt: skip
    try:
        summary = asyncio.run(
            _run_async(
                cfg, run_dir, project, model_dir, services, train_tasks, heldout,
                progress or (lambda *_: None), on_step, check, notify or (lambda message: None),
            )
        )  # fmt: skip
    finally:
        for gateway in gateways:
            gateway.stop()
        if engine is not None:
            engine.stop()
        _write_index(run_dir)
    summary["wall_seconds"] = time.time() - started
    from harnessrl.plot import reward_curve

    reward_curve(run_dir / "metrics.jsonl", summary, run_dir / "reward_curve.png")
    summary = finite_json(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    return summary


def _write_index(run_dir: Path) -> None:
    """`rollouts/index.tsv`: which rollout folder is which step, group, task and reward."""
    from harnessrl.inspect import write_rollout_index

    try:
        write_rollout_index(run_dir)
    except Exception as e:  # an index is a convenience: never fail a run over it
        log.warning("event=rollout_index_failed error=%s", e)


@dataclass(frozen=True)
class Services:
    """Where the run's gateway and engine answer, and the admin key of the gateway."""

    gateway_urls: list[str]  # one per gateway replica
    engine_url: str
    admin_key: str
    vllm: ManagedVLLM | None = None  # the run's own vLLM server (engine.kind=vllm without a URL)


async def _run_async(
    cfg: RunConfig,
    run_dir: Path,
    project: Project,
    model_dir: Path,
    services: Services,
    train_tasks: list[Task],
    heldout: list[Task],
    progress: Progress,
    on_step: Callable[[int, dict[str, Any]], None] | None,
    check: bool,
    notify: Callable[[str], None],
) -> dict[str, Any]:
    from harnessrl.trainer.weights import VLLMAdmin, engine_admin

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    client: Control = (
        ControlClient(services.gateway_urls[0], services.admin_key)
        if len(services.gateway_urls) == 1
        else GatewayReplicas(services.gateway_urls, services.admin_key)
    )
    restart = None if services.vllm is None else vllm_restarter(services.vllm, run_dir)
    engine = engine_admin(cfg.engine.kind, services.engine_url, restart=restart, sync=cfg.engine.vllm_sync)
    runner = make_runner(cfg.controller)
    controller = Controller(
        client, None, project.harness_spec(cfg.controller.harness_timeout_s), project.grader,
        run_dir,
        concurrency=cfg.controller.concurrency,
        max_attempts=cfg.controller.max_attempts,
        grader_timeout_s=cfg.controller.grader_timeout_s,
        grader_retries=cfg.controller.grader_retries,
        runner=runner,
    )  # fmt: skip
    run_id = run_id_of(run_dir)
    try:
        await runner.start()  # a fork server that cannot preload fails the run here, not per attempt
        if isinstance(engine, VLLMAdmin):  # vLLM's answers carry no version: record the one it reports
            await client.resume(weight_version=await engine.weight_version())
        if check:
            report = await preflight(controller, client, train_tasks[0], run_id, run_dir)
            log.info("event=preflight ok=%s report=%r", report.ok, report.render())
            if not report.ok:
                raise CheckFailed(report)
        model = load_model(model_dir, device=cfg.train.device)
        matmul = use_onednn_for_training(model, cfg.train.matmul, model.lm_head.weight.device)
        log.info("event=trainer_matmul path=%r", matmul)
        tc = cfg.train
        lora = attach_lora(model, tc.lora, tc.seed, model_dir) if tc.lora is not None else None
        trained = model.parameters() if lora is None else lora.parameters()  # LoRA: no state for the base
        optimizer = torch.optim.AdamW(trained, lr=tc.lr, weight_decay=tc.weight_decay)
        schedule = lr_lambda(tc.lr_schedule, tc.warmup_steps, tc.steps, tc.min_lr_ratio)
        metrics = MetricsLogger(run_dir, make_trackers(
            tc.log_to, run_dir, run_id, cfg.name, cfg.model_dump(mode="json"), tc.wandb_project, tc.wandb_mode,
            tc.mlflow_tracking_uri))  # fmt: skip
        ctx = TrainContext(
            cfg, run_id, run_dir, client, controller, engine, model, optimizer, metrics, progress,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
            ref_model=reference_model(model, model_dir, tc.device, lora) if tc.kl_coef > 0 else None,
            heldout=heldout, notify=notify, lora=lora,
        )  # fmt: skip
        if tc.world_size > 1:  # ranks 1..k-1 hold replicas; rank 0 (this process) publishes and checkpoints
            from harnessrl.trainer.distributed import DataParallel

            ctx.data_parallel = DataParallel(model, optimizer, model_dir, tc.world_size, threads=tc.threads,
                                             matmul=matmul, kl_coef=tc.kl_coef, log_dir=run_dir / "logs")  # fmt: skip
        train = run_async if tc.schedule == "async" else run_sync
        try:
            temps = [cfg.eval.temperature, *cfg.eval.extra_temperatures]
            before = [await evaluate(ctx, heldout, f"eval-before-t{t:g}", t) for t in temps]
            t_train = time.time()
            steps = await train(ctx, train_tasks, on_step)
            train_wall = time.time() - t_train - ctx.eval_seconds
            after = [await evaluate(ctx, heldout, f"eval-after-{steps}-t{t:g}", t) for t in temps]
        finally:
            metrics.close()
            if ctx.data_parallel is not None:
                ctx.data_parallel.close()
    finally:
        await client.aclose()
        await engine.aclose()
        runner.close()
    summary = summarise(cfg, before, after, steps, metrics.read())
    summary["train_wall_seconds"] = train_wall
    summary["eval_during_train_seconds"] = ctx.eval_seconds
    summary["run_dir"] = str(run_dir)
    if isinstance(engine, VLLMAdmin):  # how each weight sync into vLLM went (method, seconds)
        summary["vllm_weight_syncs"] = engine.syncs
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
        "name": cfg.name,
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
        "rollouts_failed_total": sum(r.get("rollouts_failed", 0) for r in records),
        "grader_errors_total": sum(r.get("rollouts_grader_error", 0) for r in records),
        "heldout_failed_before": before.failed,
        "heldout_failed_after": after.failed,
        # graded held-out tasks whose harness ran past its time limit (in the means above)
        "heldout_timed_out_before": before.timed_out,
        "heldout_timed_out_after": after.timed_out,
        "rollouts_timed_out_total": sum(r.get("rollouts_timed_out", 0) for r in records),
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
