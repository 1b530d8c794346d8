"""Building what a run works with, once its services answer: the gateway's control client, the
engine's admin client, the harness runner and the controller (`RunParts`), then the trainer's model,
optimizer, schedule and metrics (`TrainContext`, the schedules' view of the run)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from harnessrl.config import RunConfig
from harnessrl.controller import Controller
from harnessrl.controller.runner import Runner
from harnessrl.gateway.client import Control, ControlClient
from harnessrl.gateway.replicas import GatewayReplicas
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.hf_generic import is_generic
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.lora import attach_lora, base_view
from harnessrl.modeling.packed import use_onednn_for_training
from harnessrl.modeling.reference import reference_model
from harnessrl.runs.project import Project
from harnessrl.runs.rundir import run_id as run_id_of
from harnessrl.schema import Task
from harnessrl.services.stack import ServiceStack, vllm_restarter
from harnessrl.trainer.fsdp import meta_model
from harnessrl.trainer.loop import Progress, TrainContext
from harnessrl.trainer.metrics import MetricsLogger
from harnessrl.trainer.moe_aux import check_moe_aux
from harnessrl.trainer.packing import check_pack_rows
from harnessrl.trainer.policies import PolicyState
from harnessrl.trainer.ppo import lr_lambda
from harnessrl.trainer.precision import make_optimizer, torch_dtype
from harnessrl.trainer.trackers import make_trackers
from harnessrl.trainer.weights import EngineAdmin, engine_admin

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """The clients and the controller of one run (closed with `aclose`)."""

    run_id: str
    client: Control
    engine: EngineAdmin
    runner: Runner
    controller: Controller

    async def start(self) -> None:
        """Start the runner (a fork server that cannot preload fails the run here, not per attempt) and
        resume the gateways: a store left paused by an earlier run that stopped mid-update would hold
        every call (a gateway starts paused when its store says so), and where the engine's answers carry
        no version (vLLM) the resume records the one it reports."""
        await self.runner.start()
        await self.client.resume(weight_version=await self.engine.initial_version())

    async def aclose(self) -> None:
        """Close the clients and the runner."""
        await self.client.aclose()
        await self.engine.aclose()
        self.runner.close()


def connect(cfg: RunConfig, run_dir: Path, project: Project, stack: ServiceStack, runner: Runner) -> RunParts:
    """The run's control client (one gateway, or its replicas), engine admin and controller, over the
    services of `stack`, with `runner` starting the harness."""
    client: Control = (
        ControlClient(stack.gateway_urls[0], stack.admin_key)
        if len(stack.gateway_urls) == 1
        else GatewayReplicas(stack.gateway_urls, stack.admin_key)
    )
    restart = None if stack.vllm is None else vllm_restarter(stack.vllm, run_dir)
    engine = engine_admin(
        cfg.engine.kind,
        stack.engine_url,
        restart=restart,
        sync=cfg.engine.vllm_sync,
        api_key=stack.engine_key,
        weight_sync=cfg.engine.weight_sync,
    )
    c = cfg.controller
    controller = Controller(
        client, None, project.harness_spec(c.harness_timeout_s), project.grader, run_dir,
        concurrency=c.concurrency, max_attempts=c.max_attempts, grader_timeout_s=c.grader_timeout_s,
        grader_retries=c.grader_retries, runner=runner, guard=cfg.guard(),
    )  # fmt: skip
    return RunParts(run_id_of(run_dir), client, engine, runner, controller)


def build_trainer(
    cfg: RunConfig,
    run_dir: Path,
    model_dir: Path,
    parts: RunParts,
    heldout: list[Task],
    progress: Progress,
    notify: Callable[[str], None],
) -> TrainContext:
    """The trainer's side of the run: the model (and a frozen reference for KL), AdamW with its LR
    schedule, metrics and trackers, and with `train.world_size` > 1 the other data-parallel ranks."""
    tc = cfg.train
    dtype = torch_dtype(tc.dtype)  # FSDP keeps fp32 shards (the master weights) and computes in `dtype`
    fsdp = tc.world_size > 1 and tc.parallel == "fsdp"
    if fsdp:  # built on the meta device; the ranks then read only their shards (trainer/fsdp.py)
        model = meta_model(model_dir)
        matmul = "aten (fsdp ranks)"
    else:
        model = load_model(model_dir, dtype=dtype, device=tc.device)
        matmul = (
            "aten (transformers path)"
            if is_generic(model)
            else use_onednn_for_training(model, tc.matmul, model.lm_head.weight.device)
        )
    log.info("event=trainer_matmul path=%r", matmul)
    check_moe_aux(model, tc.moe_aux_loss_coef, tc.pack_rows)
    check_pack_rows(model, tc.pack_rows)
    schedule = lr_lambda(tc.lr_schedule, tc.warmup_steps, tc.steps, tc.min_lr_ratio)
    if cfg.policies:  # one adapter, optimizer and schedule per policy (trainer.policies)
        return _policies_trainer(cfg, run_dir, model, model_dir, parts, heldout, progress, notify, schedule)
    lora = attach_lora(model, tc.lora, tc.seed, model_dir) if tc.lora is not None else None
    trained = model.parameters() if lora is None else lora.parameters()  # LoRA: no state for the base
    optimizer = make_optimizer(
        trained,
        next(model.parameters()).dtype,
        tc.lr,
        tc.weight_decay,
        tc.exp_avg_dtype,
        tc.bf16_rounding,
        tc.seed,
    )
    metrics = MetricsLogger(run_dir, make_trackers(
        tc.log_to, run_dir, parts.run_id, cfg.name, cfg.model_dump(mode="json"), tc.wandb_project,
        tc.wandb_mode, tc.mlflow_tracking_uri))  # fmt: skip
    ctx = TrainContext(
        cfg, parts.run_id, run_dir, parts.client, parts.controller, parts.engine, model, optimizer, metrics,
        progress, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        ref_model=reference_model(model, model_dir, tc.device, lora, dtype) if tc.kl_coef > 0 and not fsdp else None,
        heldout=heldout, notify=notify, lora=lora,
    )  # fmt: skip
    if tc.teacher is not None:  # on-policy distillation (its tokenizer was checked before the run)
        from harnessrl.trainer.teacher import make_teacher

        ctx.teacher = make_teacher(tc.teacher, model_dir, tc.device)
    if tc.world_size > 1:  # ranks 1..k-1 hold replicas; rank 0 (this process) publishes and checkpoints
        from harnessrl.trainer.distributed import DataParallel

        ctx.data_parallel = DataParallel(model, optimizer, model_dir, tc.world_size, threads=tc.threads,
                                         matmul=matmul, kl_coef=tc.kl_coef, log_dir=run_dir / "logs",
                                         parallel=tc.parallel, dtype=tc.dtype, device=tc.device)  # fmt: skip
        if ctx.ref_model is None:  # fsdp: the reference sharded like the policy, built with the ranks
            ctx.ref_model = ctx.data_parallel.ref_model
    return ctx


def _policies_trainer(
    cfg: RunConfig,
    run_dir: Path,
    model: CausalLM,
    model_dir: Path,
    parts: RunParts,
    heldout: list[Task],
    progress: Progress,
    notify: Callable[[str], None],
    schedule: Callable[[int], float],
) -> TrainContext:
    """The trainer of a run with several policies: an adapter per policy on the frozen `model`, each
    with its own AdamW and LR schedule (all adapters off outside a policy's update)."""
    tc = cfg.train
    policies: dict[str, PolicyState] = {}
    for i, name in enumerate(cfg.policies):
        adapter = attach_lora(model, tc.lora, tc.seed + i, model_dir)
        adapter.enabled = False
        opt = torch.optim.AdamW(adapter.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        policies[name] = PolicyState(name, adapter, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    first = next(iter(policies.values()))
    metrics = MetricsLogger(run_dir, make_trackers(
        tc.log_to, run_dir, parts.run_id, cfg.name, cfg.model_dump(mode="json"), tc.wandb_project,
        tc.wandb_mode, tc.mlflow_tracking_uri))  # fmt: skip
    ref = base_view(model, *(p.adapter for p in policies.values())) if tc.kl_coef > 0 else None
    return TrainContext(
        cfg, parts.run_id, run_dir, parts.client, parts.controller, parts.engine, model, first.optimizer,
        metrics, progress, scheduler=first.scheduler, ref_model=ref,  # type: ignore[arg-type]
        heldout=heldout, notify=notify, policies=policies,
    )  # fmt: skip
