"""The controller: tasks in, graded rollouts out. Creates rollouts at the gateway, runs attempts
under a concurrency limit, retries infrastructure failures, grades outside the harness.

Restart safety: rollout client ids are idempotent, so a restarted controller given the same requests
finds the rollouts it had started. Finished ones are reported as stored; attempts still marked running
are reaped (their process group killed) and recorded as infrastructure failures, then retried; an
attempt that ended but was never graded is graded from its files, not run again."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.controller.grader import Grader, GraderError, grade
from harnessrl.controller.group_grading import HELD_SLOT, GroupGate, grades_groups
from harnessrl.controller.guard import GuardUnenforceable, violation_reward, write_workspace
from harnessrl.controller.runner import (
    AttemptResult,
    AttemptSpec,
    HarnessSpec,
    Runner,
    copy_files,
    reap_attempt,
    tail,
)
from harnessrl.controller.runners.local import LocalRunner
from harnessrl.gateway.client import Control, ControlError
from harnessrl.schema import (
    AttemptFinish,
    AttemptStatus,
    GuardPolicy,
    RolloutCreate,
    RolloutCreated,
    RolloutState,
    SamplingOverrides,
    Task,
)

log = logging.getLogger(__name__)
GUARD_FINDINGS = "guard_findings.json"  # beside an attempt's files: what its guard check found
MAX_REDOS = 100  # how often one request's cancelled rollout is run again under a fresh client id


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout to run: a task, its group, an idempotency id and the sampling to impose."""

    task: Task
    client_id: str
    group_id: str | None = None
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    metadata: dict[str, Any] = field(default_factory=dict)


def sibling_requests(
    task: Task, prefix: str, n: int, sampling: SamplingOverrides, metadata: dict[str, Any]
) -> list[RolloutRequest]:
    """`n` rollouts of `task` in one group: group id `<prefix>-<task_id>`, client ids `<group>-<i>`
    (ids that depend only on their arguments, so a resumed run finds the rollouts it already has)."""
    group = f"{prefix}-{task.task_id}"
    return [
        RolloutRequest(
            task=task, client_id=f"{group}-{i}", group_id=group, sampling=sampling, metadata=metadata
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class RolloutOutcome:
    """How a rollout ended: its final state and reward (None when it could not be graded)."""

    rollout_id: str
    task_id: str
    group_id: str | None
    state: RolloutState
    reward: float | None
    error: str | None = None
    # why a FAILED rollout failed: "infra" (no attempt could run), "grader" (the grader raised or
    # returned no usable reward: the harness's result was not scored), "guard" (a guard violation with
    # `on_violation: drop`: graded, but left out of the batch), None otherwise
    failure: str | None = None
    # the graded attempt ran past the harness's time limit (scored as the grader saw it: often 0); a
    # model engine too slow to answer in time shows up here, not as a failure
    timed_out: bool = False


class Controller:
    """Runs rollouts of tasks through a harness and grades them."""

    def __init__(
        self,
        client: Control,
        gateway_url: str | None,
        harness: HarnessSpec,
        grader: Grader,
        run_dir: Path,
        concurrency: int = 8,
        max_attempts: int = 2,
        grader_timeout_s: float = 60.0,
        runner: Runner | None = None,
        grader_retries: int = 0,
        guard: GuardPolicy | None = None,
    ) -> None:
        self.client = client
        # the URL harnesses call; None: the one the client picks for each rollout (its gateway replica)
        self.gateway_url = gateway_url
        self.harness = harness
        self.grader = grader
        self.run_dir = run_dir
        self.max_attempts = max_attempts
        self.grader_timeout_s = grader_timeout_s
        self.grader_retries = grader_retries  # a crashed grader is run again this many times, then FAILED
        self.runner: Runner = runner or LocalRunner()
        self.guard = guard  # every task's guard (the config's tasks.guard), merged with the task's own
        self._slots = asyncio.Semaphore(concurrency)
        # a grader that ranks whole groups (a group judge) gets each group's results together
        self._gate = GroupGate(grader, grader_timeout_s, grader_retries) if grades_groups(grader) else None  # type: ignore[arg-type]

    async def run(
        self, requests: list[RolloutRequest], on_done: Callable[[RolloutOutcome], None] | None = None
    ) -> list[RolloutOutcome]:
        """Run every request to a final state; outcomes come back in request order. A task whose guard
        the runner cannot enforce stops the run before anything starts (`GuardUnenforceable`)."""
        self.check_guards([r.task for r in requests])

        if self._gate is not None:
            for gid in {r.group_id for r in requests if r.group_id is not None}:
                self._gate.expect(gid, [r.client_id for r in requests if r.group_id == gid])

        async def one(req: RolloutRequest) -> RolloutOutcome:
            async with self._slots:
                HELD_SLOT.set(self._slots)  # a rollout waiting for its group gives its slot back
                try:
                    outcome = await self.run_one(req)
                finally:
                    if self._gate is not None:
                        self._gate.leave(req.group_id, req.client_id)
            if on_done is not None:
                on_done(outcome)
            return outcome

        return list(await asyncio.gather(*(one(r) for r in requests)))

    def guard_of(self, task: Task) -> GuardPolicy | None:
        """The guard an attempt of `task` runs under: the run's and the task's own together."""
        if self.guard is None:
            return task.guard
        return self.guard.merged(task.guard)

    def check_guards(self, tasks: list[Task]) -> None:
        """Raise `GuardUnenforceable` naming the first task whose guard this runner cannot enforce."""
        seen: set[str] = set()
        for task in tasks:
            guard = self.guard_of(task)
            if guard is None or guard.empty or (key := guard.model_dump_json()) in seen:
                continue
            seen.add(key)
            check = getattr(self.runner, "guard_problem", None)
            why = check(guard) if check is not None else f"{type(self.runner).__name__} enforces no guard"
            if why is not None:
                raise GuardUnenforceable(f"task {task.task_id!r} declares a guard: {why}")

    async def run_one(self, req: RolloutRequest) -> RolloutOutcome:
        """Create (or find) the rollout, run attempts until one yields a gradable result, grade it."""
        created = await self._create(req)
        rid = created.rollout.rollout_id
        if created.rollout.state.finished:  # an idempotent re-run: report what is stored
            detail = await self.client.rollout(rid)
            value = detail.reward.value if detail.reward else None
            return RolloutOutcome(rid, req.task.task_id, req.group_id, detail.rollout.state, value)
        try:
            used = 0
            if not created.created:  # a rollout an earlier controller started: reconcile it first
                resumed, used = await self._reconcile(req, rid, created.api_key)
                if resumed is not None:
                    return resumed
            return await self._attempts(req, rid, created.api_key, self.max_attempts - used)
        except asyncio.CancelledError:
            await self._final(rid, RolloutState.CANCELLED)
            raise
        except (ControlError, OSError) as e:
            log.error("event=rollout_error rollout=%s error=%s", rid, e)
            await self._final(rid, RolloutState.FAILED)
            return RolloutOutcome(
                rid, req.task.task_id, req.group_id, RolloutState.FAILED, None, str(e), "infra"
            )

    async def _create(self, req: RolloutRequest) -> RolloutCreated:
        """Create the rollout, or find it by its client id. A rollout found cancelled (an interrupted
        run, now resumed) is not reused: it is run again under a fresh client id (`<id>~rN`), so a
        resumed step gets its whole batch; finished and failed ones stand."""
        metadata = dict(req.metadata)
        for flag in ("allow_self_reward", "allow_annotation_rewards"):  # what the task lets its harness do
            if getattr(req.task, flag):
                metadata[flag] = True
        for redo in range(MAX_REDOS + 1):
            created = await self.client.create_rollout(
                RolloutCreate(
                    client_id=req.client_id if redo == 0 else f"{req.client_id}~r{redo}",
                    task_id=req.task.task_id,
                    input=req.task.input,
                    group_id=req.group_id,
                    metadata=metadata,
                    sampling=req.sampling,
                )
            )
            if created.rollout.state != RolloutState.CANCELLED:
                break
        return created

    def _gateway_url(self, rid: str) -> str:
        return self.gateway_url or self.client.model_url(rid)

    def _workdir(self, rid: str, attempt: int) -> Path:
        return self.run_dir / "rollouts" / rid / f"attempt-{attempt}"

    async def _reconcile(
        self, req: RolloutRequest, rid: str, api_key: str
    ) -> tuple[RolloutOutcome | None, int]:
        """After a controller restart: an attempt still marked running belonged to the dead controller.
        A runner that can reattach (`resume`, e.g. Kubernetes: the Job is still there) waits on it and
        its result is graded; otherwise what is left of it is killed and it is recorded as an
        infrastructure failure (retryable). An attempt that ended but was never graded is graded now,
        not run again. Returns (outcome if graded, attempts used up by infrastructure failures)."""
        detail = await self.client.rollout(rid)
        for a in detail.attempts:
            if a.status != AttemptStatus.RUNNING:
                continue
            spec = AttemptSpec(rid, a.attempt, api_key, self._gateway_url(rid), req.task.input,
                               self._workdir(rid, a.attempt))  # fmt: skip
            result = await self.runner.resume(spec, self.harness)  # None: this runner cannot reattach
            if result is not None:
                await self.client.finish_attempt(rid, a.attempt, _finish(result))
                if result.infra_error is None:
                    log.info("event=attempt_resumed rollout=%s attempt=%d", rid, a.attempt)
                    return await self._grade(req, rid, result), 0
                continue
            killed = reap_attempt(self._workdir(rid, a.attempt))
            log.warning("event=attempt_abandoned rollout=%s attempt=%d killed=%s", rid, a.attempt, killed)
            error = "abandoned: the controller running it stopped"
            await self.client.finish_attempt(
                rid, a.attempt, AttemptFinish(status=AttemptStatus.INFRA_ERROR, error=error)
            )
        detail = await self.client.rollout(rid)
        used = sum(a.status == AttemptStatus.INFRA_ERROR for a in detail.attempts)
        last = detail.attempts[-1] if detail.attempts else None
        if last is not None and last.status in (AttemptStatus.EXITED, AttemptStatus.TIMEOUT):
            workdir = self._workdir(rid, last.attempt)
            result = AttemptResult(
                exit_code=last.exit_code,
                timed_out=last.status == AttemptStatus.TIMEOUT,
                output_dir=workdir / "output",
                stdout_tail=_read_tail(workdir / "stdout.txt", self.harness.max_output_bytes),
                stderr_tail=_read_tail(workdir / "stderr.txt", self.harness.max_output_bytes),
                guard_findings=_saved_findings(workdir),
            )
            log.info("event=attempt_regraded rollout=%s attempt=%d", rid, last.attempt)
            return await self._grade(req, rid, result), used
        if detail.rollout.state == RolloutState.RUNNING:
            await self.client.set_state(rid, RolloutState.QUEUED)
        return None, used

    async def _attempts(self, req: RolloutRequest, rid: str, api_key: str, budget: int) -> RolloutOutcome:
        error = "no attempt was made"
        for _ in range(max(budget, 0)):
            attempt = await self.client.start_attempt(rid)
            spec = AttemptSpec(
                rollout_id=rid,
                attempt=attempt.attempt,
                api_key=api_key,
                gateway_url=self._gateway_url(rid),
                task_input=req.task.input,
                workdir=self._workdir(rid, attempt.attempt),
                guard=self.guard_of(req.task),
            )
            if self.harness.files:
                copy_files(self.harness.files, spec.workdir)
            if req.task.workspace:
                write_workspace(req.task.workspace, spec.workdir / "home")
            result = await self.runner.run(spec, self.harness)
            if result.infra_error is None and await self.client.lost(spec.gateway_url):
                result = dataclasses.replace(result, infra_error=f"the gateway {spec.gateway_url} went away "
                                             "during the attempt (its harness lost its model calls)")  # fmt: skip
            if result.infra_error is not None:
                error = result.infra_error
                await self.client.finish_attempt(rid, attempt.attempt, _finish(result))
                log.warning(
                    "event=attempt_infra_error rollout=%s attempt=%d error=%s", rid, attempt.attempt, error
                )
                await self.client.set_state(rid, RolloutState.QUEUED)
                continue
            _save_findings(spec.workdir, result.guard_findings)  # a regrade after a restart reads them
            await self.client.finish_attempt(rid, attempt.attempt, _finish(result))
            return await self._grade(req, rid, result)
        await self.client.set_state(rid, RolloutState.FAILED)
        return RolloutOutcome(rid, req.task.task_id, req.group_id, RolloutState.FAILED, None, error, "infra")

    async def _grade(self, req: RolloutRequest, rid: str, result: AttemptResult) -> RolloutOutcome:
        if req.task.allow_self_reward:  # the harness may have written its reward: it stands, unless it
            own = (await self.client.rollout(rid)).reward  # broke its guard (then graded, and that costs)
            if own is not None and not result.guard_findings:
                await self.client.set_state(rid, RolloutState.SUCCEEDED)
                return _scored(req, rid, own.value, result)
        reward, error = None, ""
        for tries in range(self.grader_retries + 1):
            try:
                if self._gate is not None:  # graded with its group (which retries on its own)
                    reward = await self._gate.verdict(req.group_id, req.client_id, req.task, result)
                else:
                    reward = await grade(self.grader, req.task, result, self.grader_timeout_s)
                break
            except GraderError as e:
                log.error("event=grader_error rollout=%s try=%d error=%s", rid, tries, e)
                error = str(e)
                if self._gate is not None:
                    break
        if reward is None:  # the grader crashed every time: the rollout fails, reported as such
            _write_grader_error(result.output_dir.parent, error)
            await self.client.set_state(rid, RolloutState.FAILED)
            return RolloutOutcome(
                rid, req.task.task_id, req.group_id, RolloutState.FAILED, None, error, "grader"
            )
        if result.guard_findings:  # a violation: zeroed, dropped or flagged (controller/guard.py)
            policy = self.guard_of(req.task)
            on_violation = policy.on_violation if policy is not None else "zero"
            reward = violation_reward(reward, result.guard_findings, on_violation)
            if on_violation == "drop":
                await self.client.set_reward(rid, reward)
                await self.client.set_state(rid, RolloutState.FAILED)
                why = "dropped: the harness changed read-only files (guard.on_violation: drop)"
                return RolloutOutcome(
                    rid, req.task.task_id, req.group_id, RolloutState.FAILED, None, why, "guard"
                )
        await self.client.set_reward(rid, reward)
        await self.client.set_state(rid, RolloutState.SUCCEEDED)
        return _scored(req, rid, reward.value, result)

    async def _final(self, rid: str, state: RolloutState) -> None:
        try:
            await self.client.set_state(rid, state)
        except (ControlError, OSError) as e:
            log.error("event=state_update_failed rollout=%s state=%s error=%s", rid, state, e)


def _scored(req: RolloutRequest, rid: str, value: float, result: AttemptResult) -> RolloutOutcome:
    """The outcome of a rollout whose attempt was graded (or rewarded by its harness)."""
    return RolloutOutcome(
        rid, req.task.task_id, req.group_id, RolloutState.SUCCEEDED, value, timed_out=result.timed_out
    )


def _write_grader_error(workdir: Path, error: str) -> None:
    """Keep the grader's error beside the attempt's files (`grader_error.txt`) for `inspect` and users."""
    try:
        (workdir / "grader_error.txt").write_text(error + "\n")
    except OSError as e:
        log.warning("event=grader_error_not_saved workdir=%s error=%s", workdir, e)


def _save_findings(workdir: Path, findings: dict[str, Any] | None) -> None:
    """Keep what the guard check found beside the attempt's files (`guard_findings.json`), so a
    controller that restarts before grading still zeroes (or drops) a violating attempt."""
    if findings:
        (workdir / GUARD_FINDINGS).write_text(json.dumps(findings))


def _saved_findings(workdir: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((workdir / GUARD_FINDINGS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable: still a violation, never a silent pass
        return {"unreadable_findings": str(e)}
    return found if isinstance(found, dict) and found else None


def _read_tail(path: Path, limit: int) -> str:
    try:
        return tail(path, limit)
    except OSError:
        return ""


def _finish(result: AttemptResult) -> AttemptFinish:
    if result.infra_error is not None:
        return AttemptFinish(status=AttemptStatus.INFRA_ERROR, error=result.infra_error)
    if result.timed_out:
        return AttemptFinish(status=AttemptStatus.TIMEOUT, error="harness ran past its time limit")
    return AttemptFinish(status=AttemptStatus.EXITED, exit_code=result.exit_code)
