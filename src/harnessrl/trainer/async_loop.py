"""The collocated async schedule: more groups in flight than one batch; an update as soon as
`batch_groups` whole groups are graded; the other groups carry over and go on under the new weights.

    launch groups until max_inflight_groups are running
    while step < steps:
        wait until batch_groups groups are graded (refilling the running ones as they finish)
        batch = build_batch(the oldest graded groups; rows staler than max_staleness dropped)
        gateway.pause()                       # calls in flight drain, new calls wait
        ppo_update(batch); engine.load_weights(step + 1); gateway.resume(step + 1)

Engine and trainer time-share the same cores: during the update the gateway holds every call, so the
engine is idle and the trainer has the machine; between updates the trainer waits for groups. What
the schedule wins over sync is the harness time that is not model time (tools, sandboxes, slow
graders): it goes on during the update, and a slow rollout delays only its own group. Every call
records the weight version that served it; a rollout that spans an update has calls of two versions,
and `train.tis_cap` corrects for the gap with truncated importance sampling.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from harnessrl.controller import RolloutOutcome, RolloutRequest, sibling_requests
from harnessrl.schema import RolloutState, SamplingOverrides, Task
from harnessrl.trainer.budget import TimeBudget
from harnessrl.trainer.loop import (
    TrainContext,
    apply_update,
    batch_metrics,
    fetch_details,
    make_batch,
    maybe_checkpoint,
    maybe_eval,
    restore,
)
from harnessrl.trainer.trackers import sample_table


def group_requests(ctx: TrainContext, train_tasks: list[Task], k: int) -> list[RolloutRequest]:
    """The rollouts of group `k`: one task (seeded by k) × `group_size` siblings, with client ids that
    depend only on the run and k, so a resumed run finds the rollouts it already has."""
    t = ctx.cfg.train
    task = random.Random(f"{t.seed}-group-{k}").choice(train_tasks)
    sampling = SamplingOverrides(temperature=t.temperature)
    return sibling_requests(task, f"{ctx.run_id}-g{k}", t.group_size, sampling, {"group": k})


class GroupPool:
    """The groups launched and not yet trained on, as asyncio tasks keyed by group index."""

    def __init__(self, ctx: TrainContext, train_tasks: list[Task], next_group: int) -> None:
        self.ctx, self.train_tasks, self.next_group = ctx, train_tasks, next_group
        self.tasks: dict[int, asyncio.Task[list[RolloutOutcome]]] = {}
        self.discarded = 0  # groups left out because a rollout of theirs was cancelled

    def launch(self, k: int) -> None:
        """Start group `k`."""
        self.tasks[k] = asyncio.create_task(
            self.ctx.controller.run(group_requests(self.ctx, self.train_tasks, k))
        )

    def running(self) -> int:
        """Groups still rolling out."""
        return sum(not x.done() for x in self.tasks.values())

    def graded(self) -> list[int]:
        """Indices of the groups whose rollouts all finished, oldest first. A group with a cancelled
        rollout (cancelled when an earlier run stopped with it in flight) is discarded: its siblings
        alone would give it a wrong baseline."""
        for k in [k for k, x in self.tasks.items() if x.done() and not x.cancelled()]:
            if any(o.state == RolloutState.CANCELLED for o in self.tasks[k].result()):
                del self.tasks[k]
                self.discarded += 1
        return sorted(k for k, x in self.tasks.items() if x.done())

    def refill(self, limit: int) -> None:
        """Launch new groups until `limit` are running."""
        while self.running() < limit:
            self.launch(self.next_group)
            self.next_group += 1

    async def wait_graded(self, n: int, limit: int, report: Callable[[int], None]) -> None:
        """Return once `n` groups are graded, keeping `limit` groups running meanwhile."""
        self.refill(limit)
        while len(self.graded()) < n:
            await asyncio.wait(
                [x for x in self.tasks.values() if not x.done()], return_when=asyncio.FIRST_COMPLETED
            )
            report(len(self.graded()))
            self.refill(limit)

    def take(self, n: int) -> list[RolloutOutcome]:
        """Remove the `n` oldest graded groups and return their outcomes."""
        return [o for k in self.graded()[:n] for o in self.tasks.pop(k).result()]

    async def cancel(self) -> None:
        """Cancel every group still running (their rollouts end as cancelled) and wait for them."""
        for x in self.tasks.values():
            x.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def run_async(
    ctx: TrainContext, train_tasks: list[Task], on_step: Callable[[int, dict[str, Any]], None] | None = None
) -> int:
    """Train from the last checkpoint to `train.steps` (or until `train.time_budget_s` ran out: then with
    a checkpoint of the step it stopped after) with the async schedule; returns the steps done."""
    t = ctx.cfg.train
    budget = TimeBudget(t.time_budget_s)
    state = await restore(ctx)
    step = int(state["step"])
    pool = GroupPool(ctx, train_tasks, int(state.get("next_group", 0)))
    for k in state.get("pending_groups", []):  # groups in flight at the checkpoint: rerun (idempotent ids)
        pool.launch(int(k))
    try:
        while step < t.steps:
            label = f"step {step + 1} groups"

            def report(n: int, label: str = label) -> None:
                ctx.progress(label, min(n, t.batch_groups), t.batch_groups)

            t0 = time.perf_counter()
            await pool.wait_graded(t.batch_groups, t.max_inflight_groups, report)
            t1 = time.perf_counter()
            outcomes = pool.take(t.batch_groups)
            details = await fetch_details(ctx.client, outcomes)
            batch = make_batch(ctx, details, version=step)
            ctx.metrics.log_samples(step + 1, sample_table(step + 1, details, batch, t.sample_rollouts))
            carried = len(pool.tasks)
            update = await apply_update(ctx, batch, step + 1)
            step += 1
            metrics = {
                **batch_metrics(batch, outcomes),
                **update,
                "time_rollout_s": t1 - t0,
                "trainer_idle_s": t1 - t0,  # the trainer waits for graded groups
                "engine_idle_s": update["time_paused_s"],  # the gateway holds every call
                "groups_carried_over": carried,
                "groups_running": pool.running(),
                "groups_discarded": pool.discarded,
                "time_step_s": time.perf_counter() - t0,
            }
            # groups in flight go on during an `eval.every` evaluation (its rollouts share the engine)
            metrics.update(await maybe_eval(ctx, step))
            ctx.metrics.log(step, metrics)
            if on_step is not None:
                on_step(step, metrics)
            stopping = budget.stops(step, t.steps)
            loop_state = {"next_group": pool.next_group, "pending_groups": sorted(pool.tasks)}
            checkpoint = maybe_checkpoint(ctx, step, loop_state, stopping)
            if stopping:
                budget.note_stop(step, t.steps, checkpoint, ctx.notify)
                return step
    finally:
        await pool.cancel()
    return t.steps
