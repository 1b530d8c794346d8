"""The sync schedule: roll out a batch → pause → update → load weights → resume. And evaluation.

for step in range(start, steps):
    outcomes = controller.run(batch_groups tasks × group_size rollouts)   # harness + grader
    batch    = build_batch(rollout details)                              # merge, advantage, weights
    gateway.pause(); ppo_update(batch); engine.load_weights(step + 1); gateway.resume()

The collocated async schedule (`trainer.async_loop`) shares `make_batch`, `apply_update` and the
checkpoint helpers with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from harnessrl.adapter import Batch, build_batch
from harnessrl.config import RunConfig
from harnessrl.controller import Controller, RolloutOutcome, RolloutRequest, sibling_requests
from harnessrl.gateway.client import Control
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.lora import LoraAdapter
from harnessrl.schema import RolloutDetail, RolloutState, SamplingOverrides, Task
from harnessrl.trainer.budget import TimeBudget
from harnessrl.trainer.checkpoint import (
    checkpoint_due,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from harnessrl.trainer.distributed import DataParallel
from harnessrl.trainer.metrics import MetricsLogger, mean_ci95
from harnessrl.trainer.policies import (
    PolicyState,
    load_policies_checkpoint,
    policies_update,
    publish_policies,
    save_policies_checkpoint,
)
from harnessrl.trainer.ppo import PPOConfig, ppo_update
from harnessrl.trainer.teacher import Teacher, distill_batch
from harnessrl.trainer.trackers import sample_table
from harnessrl.trainer.weights import EngineAdmin, publish_weights

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """Held-out reward: mean, 95% interval, number of tasks."""

    mean: float
    lo: float
    hi: float
    n: int
    rewards: list[float] = field(default_factory=list)
    failed: int = 0  # tasks whose rollout could not be run or graded: left out of the mean, reported
    timed_out: int = 0  # graded tasks whose harness ran past its time limit: in the mean, reported

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "mean": self.mean, "ci95": [self.lo, self.hi], "n": self.n, "failed": self.failed,
            "timed_out": self.timed_out,
        }  # fmt: skip


Progress = Callable[[str, int, int], None]  # (label, done, total) as rollouts finish


@dataclass
class TrainContext:
    """Everything the schedule talks to."""

    cfg: RunConfig
    run_id: str
    run_dir: Path
    client: Control
    controller: Controller
    engine: EngineAdmin
    model: CausalLM
    optimizer: torch.optim.Optimizer
    metrics: MetricsLogger
    progress: Progress = lambda label, done, total: None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    ref_model: CausalLM | None = None  # frozen initial weights, for the KL penalty
    heldout: list[Task] = field(default_factory=list)  # for `eval.every`
    eval_seconds: float = 0.0  # spent in evaluations during training (`eval.every`)
    notify: Callable[[str], None] = lambda message: None  # warnings for the user (the CLI prints them)
    data_parallel: DataParallel | None = None  # the other trainer ranks, with `train.world_size` > 1
    lora: LoraAdapter | None = None  # `train.lora`: the adapter trained (the model's weights stay frozen)
    # `policies:`: one adapter, optimizer and schedule per policy (trainer.policies); `lora` is None then
    policies: dict[str, PolicyState] = field(default_factory=dict)
    teacher: Teacher | None = None  # `train.teacher`: scores the student's tokens (on-policy distillation)

    @property
    def ppo(self) -> PPOConfig:
        """The update's hyperparameters."""
        t = self.cfg.train
        return PPOConfig(**{f.name: getattr(t, f.name) for f in dataclasses.fields(PPOConfig)})


class EvalTarget(Protocol):
    """What running rollouts and evaluating need of a run (a `TrainContext`, or `harnessrl eval`'s)."""

    @property
    def run_id(self) -> str: ...

    @property
    def controller(self) -> Controller: ...

    @property
    def progress(self) -> Progress: ...

    @property
    def notify(self) -> Callable[[str], None]: ...


async def run_rollouts(ctx: EvalTarget, requests: list[RolloutRequest], label: str) -> list[RolloutOutcome]:
    """Run rollouts through the controller, reporting progress as they finish."""
    done = 0

    def on_done(_: RolloutOutcome) -> None:
        nonlocal done
        done += 1
        ctx.progress(label, done, len(requests))

    return await ctx.controller.run(requests, on_done=on_done)


async def evaluate(ctx: EvalTarget, tasks: list[Task], label: str, temperature: float) -> EvalResult:
    """Held-out reward of the current weights: one rollout per task at `temperature`."""
    sampling = SamplingOverrides(temperature=temperature)
    requests = [
        RolloutRequest(
            task=t, client_id=f"{ctx.run_id}-{label}-{t.task_id}", sampling=sampling, metadata={"eval": label}
        )
        for t in tasks
    ]
    outcomes = await run_rollouts(ctx, requests, label)
    rewards = [o.reward for o in outcomes if o.reward is not None]
    failed = [o for o in outcomes if o.reward is None]
    if failed:
        log.warning(
            "event=eval_failures label=%s failed=%d of=%d first_error=%r",
            label, len(failed), len(outcomes), failed[0].error,
        )  # fmt: skip
        ctx.notify(
            f"warning: {label}: {len(failed)} of {len(outcomes)} rollouts could not be run or graded "
            f"(left out of the mean); first error: {failed[0].error}"
        )
    timed_out = sum(o.timed_out for o in outcomes if o.reward is not None)
    if timed_out:
        log.warning("event=eval_timeouts label=%s timed_out=%d of=%d", label, timed_out, len(outcomes))
        ctx.notify(
            f"warning: {label}: {timed_out} of {len(outcomes)} harnesses ran past their time limit and were "
            "graded as they stood (a model engine too slow for controller.harness_timeout_s looks like this)"
        )
    mean, lo, hi = mean_ci95(rewards)
    return EvalResult(mean, lo, hi, len(rewards), rewards, len(failed), timed_out)


async def maybe_eval(ctx: TrainContext, step: int) -> dict[str, Any]:
    """The held-out evaluation after update `step` when `eval.every` asks for one (not after the last
    update: the run evaluates then anyway); its metrics, or {} when there is none."""
    every, steps = ctx.cfg.eval.every, ctx.cfg.train.steps
    if not every or step % every or step >= steps or not ctx.heldout:
        return {}
    t0 = time.perf_counter()
    temperature = ctx.cfg.eval.temperature
    r = await evaluate(ctx, ctx.heldout, f"eval-step{step}-t{temperature:g}", temperature)
    seconds = time.perf_counter() - t0
    ctx.eval_seconds += seconds
    log.info(
        "event=heldout step=%d reward=%.3f ci95=[%.3f, %.3f] seconds=%.1f", step, r.mean, r.lo, r.hi, seconds
    )
    return {"heldout_reward": r.mean, "heldout_ci95": [r.lo, r.hi], "time_eval_s": seconds}


def step_requests(ctx: TrainContext, train_tasks: list[Task], step: int) -> list[RolloutRequest]:
    """The rollouts of one step: `batch_groups` tasks (seeded by step) × `group_size` siblings."""
    t = ctx.cfg.train
    rng = random.Random(t.seed * 1_000_003 + step)
    tasks = rng.sample(train_tasks, min(t.batch_groups, len(train_tasks)))
    sampling = SamplingOverrides(temperature=t.temperature)
    prefix = f"{ctx.run_id}-s{step}"
    return [
        r for task in tasks for r in sibling_requests(task, prefix, t.group_size, sampling, {"step": step})
    ]


async def fetch_details(client: Control, outcomes: list[RolloutOutcome]) -> list[RolloutDetail]:
    """The recorded calls and rewards of the rollouts that were graded."""
    ok = [o for o in outcomes if o.state == RolloutState.SUCCEEDED]
    return list(await asyncio.gather(*(client.rollout(o.rollout_id) for o in ok)))


def make_batch(ctx: TrainContext, details: list[RolloutDetail], version: int | None = None) -> Batch:
    """The training batch of graded rollouts under the run's adapter settings (staleness at `version`)."""
    t = ctx.cfg.train
    return build_batch(
        details, t.advantage_level, t.estimator, t.loss_mode, t.zero_variance,
        max_row_tokens=t.max_row_tokens, version=version, max_staleness=t.max_staleness,
        include_failed_attempts=t.train_on_failed_attempts, merge=t.merge_calls,
        credit=t.credit, step_coef=t.step_coef,
    )  # fmt: skip


async def apply_update(ctx: TrainContext, batch: Batch, new_version: int) -> dict[str, Any]:
    """Pause the gateway (in-flight generations cut and resent after resume, or drained; see
    `train.preempt_on_pause`), update (the engine asleep if `train.engine_sleep_level`), publish weights
    `new_version`, resume."""
    t0 = time.perf_counter()
    paused = await ctx.client.pause(preempt=ctx.cfg.train.preempt_on_pause)
    sleep_level = ctx.cfg.train.engine_sleep_level
    if sleep_level:  # collocated: the engine gives its memory to the update
        await ctx.engine.sleep(sleep_level)
    t1 = time.perf_counter()
    label = f"update {new_version}"
    if ctx.policies:  # one update per policy, each moving its own adapter only
        update = policies_update(ctx.model, ctx.policies, batch, ctx.ppo, ctx.ref_model,
                                 progress=lambda done, total: ctx.progress(label, done, total))  # fmt: skip
    elif ctx.data_parallel is not None:  # every rank takes its share of the rows
        update = ctx.data_parallel.update(batch, ctx.ppo, ctx.ref_model, ctx.scheduler,
                                          progress=lambda done, total: ctx.progress(label, done, total))  # fmt: skip
    else:
        update = ppo_update(ctx.model, ctx.optimizer, batch, ctx.ppo, ctx.ref_model, ctx.scheduler,
                            progress=lambda done, total: ctx.progress(label, done, total))  # fmt: skip
    t2 = time.perf_counter()
    if sleep_level:
        await ctx.engine.wake_up()
    await publish(ctx, new_version)
    await ctx.client.resume(weight_version=new_version)
    t3 = time.perf_counter()
    return {
        **update,
        "time_drain_s": t1 - t0,
        "time_update_s": t2 - t1,
        "time_weight_sync_s": t3 - t2,
        "time_paused_s": t3 - t0,
        "preempted_calls_total": paused.get("preempted_calls", 0),
        "weight_version": new_version,
    }


async def publish(ctx: TrainContext, version: int) -> None:
    """Load the trained weights into the engine as `version`: every policy's adapter, the adapter, or
    the whole model."""
    if ctx.policies:
        await publish_policies(ctx.policies, ctx.engine, ctx.run_dir / "weights", version)
    else:
        await publish_weights(full_model(ctx), ctx.engine, ctx.run_dir / "weights", version, ctx.lora)


def full_model(ctx: TrainContext) -> CausalLM:
    """The whole policy for the engine: the model itself, or gathered on rank 0 from sharded ranks."""
    return ctx.data_parallel.full_model() if ctx.data_parallel is not None else ctx.model


async def train_step(ctx: TrainContext, train_tasks: list[Task], step: int) -> dict[str, Any]:
    """One sync step; returns its metrics. The engine serves version `step + 1` afterwards."""
    t0 = time.perf_counter()
    outcomes = await run_rollouts(ctx, step_requests(ctx, train_tasks, step), f"step {step + 1} rollouts")
    details = await fetch_details(ctx.client, outcomes)
    batch = make_batch(ctx, details, version=step)
    t = ctx.cfg.train
    distill: dict[str, Any] = {}
    if ctx.teacher is not None and t.teacher is not None:  # per-token reverse KL as the advantage
        distill = await distill_batch(ctx.teacher, batch, t.distill_coef, t.teacher.rl,
                                      ctx.run_dir / "teacher_logprobs.jsonl", step + 1)  # fmt: skip
    ctx.metrics.log_samples(step + 1, sample_table(step + 1, details, batch, t.sample_rollouts))
    t1 = time.perf_counter()
    update = await apply_update(ctx, batch, step + 1)
    return {
        **batch_metrics(batch, outcomes),
        **distill,
        **update,
        "time_rollout_s": t1 - t0,
        "time_step_s": time.perf_counter() - t0,
    }


def batch_metrics(batch: Batch, outcomes: list[RolloutOutcome]) -> dict[str, Any]:
    """Reward, token and merge statistics of a step."""
    rewards = list(batch.rewards.values())
    stats = batch.stats.as_dict()
    return {
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "rollouts": len(outcomes),
        "rollouts_failed": sum(o.state != RolloutState.SUCCEEDED for o in outcomes),
        "rollouts_grader_error": sum(o.failure == "grader" for o in outcomes),
        "rollouts_infra_error": sum(o.failure == "infra" for o in outcomes),
        "rollouts_guard_dropped": sum(o.failure == "guard" for o in outcomes),  # guard.on_violation: drop
        "rollouts_timed_out": sum(o.timed_out for o in outcomes),
        "first_error": next((o.error for o in outcomes if o.error), None),
        "rows": len(batch.rows),
        "rows_per_rollout": stats["rows_per_rollout"],
        "calls": stats["calls"],
        "merge_rate": stats["merge_rate"],
        "breaks": stats["breaks"],
        "tokens": sum(len(r.tokens) for r in batch.rows),
        "trainable_tokens": batch.n_trainable_tokens,
        "zero_adv_rows": sum(not batch.has_signal(i) for i in range(len(batch.rows))),
        "groups": batch.groups,
        "zero_variance_groups": batch.zero_variance_groups,
        "dropped_rows": batch.dropped_rows,
        "truncated_rows": batch.length.truncated_rows,
        "dropped_long_rows": batch.length.dropped_rows,
        "staleness": batch.staleness.as_dict(),
        "dropped_stale_rows": batch.staleness.dropped_rows,
        "rollouts_flagged_hacking": len(batch.flagged_hacking),
        **({"step_rewards": batch.steps.as_dict()} if batch.token_advantages is not None else {}),
    }


async def restore(ctx: TrainContext) -> dict[str, Any]:
    """Resume from the newest checkpoint, if any: restore the training state, publish its weights and
    return the saved loop state (`{"step": 0}` for a fresh run)."""
    ckpt = latest_checkpoint(ctx.run_dir / "checkpoints")
    if ckpt is None:
        ctx.metrics.truncate_after(0)
        if ctx.policies:  # the engine serves each policy's adapter by name from the first call on
            await publish(ctx, 0)
        return {"step": 0}
    if ctx.policies:
        state = load_policies_checkpoint(ckpt, ctx.policies)
    elif ctx.data_parallel is not None:  # every rank takes the checkpoint's weights and moments
        state = ctx.data_parallel.load_checkpoint(ckpt, ctx.scheduler)
    else:
        state = load_checkpoint(ckpt, ctx.model, ctx.optimizer, ctx.scheduler, ctx.lora)
    step = int(state["step"])
    ctx.metrics.truncate_after(step)  # steps after the checkpoint are done again: logged once
    await publish(ctx, step)
    await ctx.client.resume(weight_version=step)
    log.info("event=resumed step=%d checkpoint=%s", step, ckpt)
    return state


def maybe_checkpoint(
    ctx: TrainContext, step: int, loop_state: dict[str, Any] | None = None, stopping: bool = False
) -> Path | None:
    """Save a checkpoint after update `step` if the schedule says so (every N, the last one, and the one
    a run stops after early: `stopping`), pruned to the newest `train.keep_checkpoints`; its path, or None."""
    t = ctx.cfg.train
    if not checkpoint_due(step, t.steps, t.checkpoint_every, stopping):
        return None
    state = {"run_id": ctx.run_id, **(loop_state or {})}
    ckpt_dir = ctx.run_dir / "checkpoints"
    if ctx.policies:
        path = save_policies_checkpoint(ckpt_dir, step, ctx.policies, state)
    elif ctx.data_parallel is not None:  # sharded ranks: rank 0 gathers, writes the single-process format
        path = ctx.data_parallel.save_checkpoint(ckpt_dir, step, state, ctx.scheduler)
    else:
        path = save_checkpoint(ckpt_dir, step, ctx.model, ctx.optimizer, state, ctx.scheduler, ctx.lora)
    prune_checkpoints(ckpt_dir, t.keep_checkpoints)
    return path


async def run_sync(
    ctx: TrainContext, train_tasks: list[Task], on_step: Callable[[int, dict[str, Any]], None] | None = None
) -> int:
    """Train from the last checkpoint to `train.steps` (or until `train.time_budget_s` ran out: then with
    a checkpoint of the step it stopped after); returns the number of steps done in total."""
    t = ctx.cfg.train
    budget = TimeBudget(t.time_budget_s)
    start = int((await restore(ctx))["step"])
    for step in range(start, t.steps):
        metrics = await train_step(ctx, train_tasks, step)
        metrics.update(await maybe_eval(ctx, step + 1))
        ctx.metrics.log(step + 1, metrics)
        if on_step is not None:
            on_step(step + 1, metrics)
        stopping = budget.stops(step + 1, t.steps)
        checkpoint = maybe_checkpoint(ctx, step + 1, stopping=stopping)
        if stopping:
            budget.note_stop(step + 1, t.steps, checkpoint, ctx.notify)
            return step + 1
    return t.steps
