"""The preflight check: one attempt of the harness on one training task, graded, before any training.

`harnessrl check --config C` runs it on its own (engine and gateway started for it); `train` runs it
first through the run's own services (skip with `--no-check`). It fails, with the cause on one screen,
when the harness cannot start, makes no model call, gets no token IDs recorded, or the grader raises.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.config import RunConfig, check_model
from harnessrl.controller import Controller, RolloutRequest
from harnessrl.controller.factory import make_runner
from harnessrl.controller.runner import tail
from harnessrl.gateway.client import Control, ControlClient
from harnessrl.modeling.families import describe_path
from harnessrl.modeling.loading import resolve_model
from harnessrl.runs.project import resolve_project
from harnessrl.schema import RolloutState, SamplingOverrides, Task
from harnessrl.services.stack import start_services

STDERR_LINES = 15  # lines of the harness's stderr shown in a report


@dataclass
class CheckReport:
    """What one checked attempt did."""

    task_id: str
    rollout_id: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    calls: int = 0
    calls_with_token_ids: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reward: float | None = None
    reward_details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stderr_tail: str = ""
    seconds: float = 0.0
    workdir: str = ""
    problems: list[str] = field(default_factory=list)
    model_path: str = ""  # which implementation computes the model (modeling/families.py's `describe_path`)

    @property
    def ok(self) -> bool:
        """True when nothing stands in the way of training."""
        return not self.problems

    def render(self) -> str:
        """The report as a few lines of text."""
        status = "timed out" if self.timed_out else f"exit code {self.exit_code}"
        lines = [
            f"check: task {self.task_id}, rollout {self.rollout_id or '-'} ({self.seconds:.1f}s)",
            f"  harness      {status}",
            f"  model calls  {self.calls} recorded, {self.calls_with_token_ids} with token IDs "
            f"({self.prompt_tokens} prompt + {self.completion_tokens} completion tokens)",
            f"  reward       {'-' if self.reward is None else f'{self.reward:g}'}"
            + (f"  {self.reward_details}" if self.reward_details else ""),
        ]
        if self.model_path:
            lines.insert(1, f"  model        {self.model_path}")
        if self.error:
            lines.append(f"  error        {self.error}")
        if self.stderr_tail.strip():
            lines.append("  harness stderr (last lines):")
            lines += [f"    {x}" for x in self.stderr_tail.rstrip().splitlines()[-STDERR_LINES:]]
        if self.workdir:
            lines.append(f"  files        {self.workdir}")
        lines.append("  result       " + ("OK" if self.ok else "FAILED"))
        lines += [f"  problem      {p}" for p in self.problems]
        return "\n".join(lines)


async def preflight(
    controller: Controller, client: Control, task: Task, run_id: str, run_dir: Path
) -> CheckReport:
    """Run and grade one attempt of `task` (greedy) and report what it did."""
    t0 = time.perf_counter()
    req = RolloutRequest(
        task=task,
        client_id=f"{run_id}-check-{secrets.token_hex(3)}",
        sampling=SamplingOverrides(temperature=0.0),
        metadata={"check": True},
    )
    outcome = await controller.run_one(req)
    report = CheckReport(task_id=task.task_id, rollout_id=outcome.rollout_id, error=outcome.error)
    detail = await client.rollout(outcome.rollout_id)
    calls = detail.calls
    report.calls = len(calls)
    report.calls_with_token_ids = sum(bool(c.prompt_ids) and bool(c.completion_ids) for c in calls)
    report.prompt_tokens = sum(len(c.prompt_ids or []) for c in calls)
    report.completion_tokens = sum(len(c.completion_ids or []) for c in calls)
    if detail.attempts:
        last = detail.attempts[-1]
        report.exit_code, report.timed_out = last.exit_code, last.status == "timeout"
        workdir = run_dir / "rollouts" / outcome.rollout_id / f"attempt-{last.attempt}"
        report.workdir = str(workdir)
        report.stderr_tail = _tail(workdir / "stderr.txt")
    if detail.reward is not None:
        report.reward, report.reward_details = detail.reward.value, dict(detail.reward.details)
    report.seconds = time.perf_counter() - t0
    report.problems = _problems(report, outcome.state, outcome.failure)
    return report


def _problems(r: CheckReport, state: RolloutState, failure: str | None) -> list[str]:
    out = []
    if failure == "infra":
        out.append(f"the harness could not run: {r.error}")
    elif failure == "grader":
        out.append(f"the grader failed: {r.error}")
    elif state != RolloutState.SUCCEEDED:
        out.append(f"the rollout ended {state}: {r.error}")
    if failure != "infra" and r.calls == 0:
        out.append(
            "the harness made no model call: does it read OPENAI_BASE_URL / ANTHROPIC_BASE_URL and the "
            "key from its environment? (its stderr is above)"
        )
    elif r.calls_with_token_ids < r.calls:
        out.append(f"{r.calls - r.calls_with_token_ids} of {r.calls} calls have no token IDs recorded")
    if r.timed_out:
        out.append("the harness ran past controller.harness_timeout_s")
    return out


def _tail(path: Path) -> str:
    try:
        return tail(path, 4000)
    except OSError:
        return ""


def run_check(cfg: RunConfig, task_index: int = 0) -> CheckReport:
    """`harnessrl check`: start the engine and gateway for `cfg`, run the preflight on one training
    task in a scratch directory (kept: its path is in the report), stop everything."""
    check_model(cfg)
    project = resolve_project(cfg)
    train, _ = project.splits(cfg)
    if not train:
        raise ValueError("the task source produced no training task")
    task = train[min(task_index, len(train) - 1)]
    harness = project.harness_spec(cfg.controller.harness_timeout_s)
    runner = make_runner(cfg.controller, harness)  # refuses a harness the sandbox cannot start
    scratch = Path(tempfile.mkdtemp(prefix="harnessrl-check-"))
    admin_key = secrets.token_hex(16)
    model_dir = resolve_model(cfg.engine.model)
    stack = start_services(cfg, scratch, model_dir, admin_key)
    gateway_url = stack.gateway_urls[0]  # the first replica serves every request here

    async def go() -> CheckReport:
        client = ControlClient(gateway_url, admin_key)
        controller = Controller(
            client, gateway_url, harness, project.grader,
            scratch, concurrency=1, max_attempts=1, grader_timeout_s=cfg.controller.grader_timeout_s,
            runner=runner, guard=cfg.guard(),
        )  # fmt: skip
        try:
            await runner.start()
            report = await preflight(controller, client, task, "check", scratch)
            report.model_path = model_path_line(cfg, model_dir)
            return report
        finally:
            await client.aclose()
            runner.close()

    try:
        return asyncio.run(go())
    finally:
        stack.stop()


def model_path_line(cfg: RunConfig, model_dir: Path) -> str:
    """Which implementation computes the model (`engine.model_impl`, decided from config.json)."""
    if cfg.engine.kind != "builtin":
        return f"{cfg.engine.kind} serves it; the trainer: " + describe_path(model_dir, cfg.engine.model_impl)
    return describe_path(model_dir, cfg.engine.model_impl)
