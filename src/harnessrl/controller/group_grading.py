"""Grading a whole group in one go (a judge that ranks the group's answers side by side).

A grader with `grades_groups = True` has `grade_group(task, results) -> list[RewardIn]`. The controller
then does not grade a rollout when its attempt ends: the rollout waits at the `GroupGate` until every
other rollout of its group has either ended its attempt too or left without one (an infrastructure
failure, a cancelled or an already finished rollout), and the last one to arrive grades them all at once.

A waiting rollout gives its concurrency slot back while it waits (`waiting_without_slot`), so a group
larger than `controller.concurrency` still fills: its other rollouts get the slots to run. A failure of
`grade_group` (a crash, a time-out, a reward that is not one, the wrong number of rewards) is a grader
error for every rollout of the group; `retries` asks again first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from harnessrl.controller.grader import GraderError, as_reward
from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, Task

log = logging.getLogger(__name__)

# The concurrency slot the current rollout holds (None outside `Controller.run`): released while it
# waits for its group, taken again before it goes on.
HELD_SLOT: contextvars.ContextVar[asyncio.Semaphore | None] = contextvars.ContextVar(
    "held_slot", default=None
)


class GroupGrader(Protocol):
    """A grader that scores a group's results together (`grades_groups` is True)."""

    grades_groups: bool

    def grade_group(self, task: Task, results: list[AttemptResult]) -> list[RewardIn]: ...


def grades_groups(grader: Any) -> bool:
    """Whether the controller should hand `grader` whole groups."""
    return getattr(grader, "grades_groups", False) is True and callable(getattr(grader, "grade_group", None))


@contextlib.asynccontextmanager
async def waiting_without_slot() -> AsyncIterator[None]:
    """Give the held concurrency slot back for the duration of the block, and take it again after."""
    slot = HELD_SLOT.get()
    if slot is not None:
        slot.release()
    try:
        yield
    finally:
        if slot is not None:
            await slot.acquire()


@dataclass
class _Group:
    expected: set[str]
    task: Task | None = None
    arrived: dict[str, tuple[AttemptResult, asyncio.Future[RewardIn]]] = field(default_factory=dict)
    fired: bool = False


class GroupGate:
    """Collects the results of a group's rollouts and grades them together (module docstring)."""

    def __init__(self, grader: GroupGrader, timeout_s: float = 60.0, retries: int = 0) -> None:
        self.grader, self.timeout_s, self.retries = grader, timeout_s, retries
        self._groups: dict[str, _Group] = {}

    def expect(self, group_id: str, members: list[str]) -> None:
        """Announce the rollouts (by client id) a group will have."""
        group = self._groups.setdefault(group_id, _Group(set()))
        group.expected.update(members)

    async def verdict(self, group_id: str | None, member: str, task: Task, result: AttemptResult) -> RewardIn:
        """The reward of `member`'s result, once its whole group is graded (`GraderError` on failure)."""
        key = group_id if group_id is not None and group_id in self._groups else f"alone:{member}"
        group = self._groups.setdefault(key, _Group({member}))
        group.expected.add(member)
        group.task = group.task or task
        future: asyncio.Future[RewardIn] = asyncio.get_running_loop().create_future()
        group.arrived[member] = (result, future)
        self._maybe_fire(key)
        async with waiting_without_slot():
            return await future

    def leave(self, group_id: str | None, member: str) -> None:
        """`member` is done: if it never arrived it will not, so its group no longer waits for it."""
        key = group_id if group_id is not None else f"alone:{member}"
        group = self._groups.get(key)
        if group is None:
            return
        if member not in group.arrived:
            group.expected.discard(member)
            if not group.expected and not group.arrived:  # nobody of the group got to grading
                self._groups.pop(key, None)
                return
            self._maybe_fire(key)
        if (
            group.fired
            and all(f.done() for _, f in group.arrived.values())
            and not (group.expected - set(group.arrived))
        ):
            self._groups.pop(key, None)

    def _maybe_fire(self, key: str) -> None:
        group = self._groups[key]
        if group.fired or not group.arrived or not group.expected <= set(group.arrived):
            return
        group.fired = True
        asyncio.get_running_loop().create_task(self._grade(key, group))

    async def _grade(self, key: str, group: _Group) -> None:
        members = list(group.arrived)
        results = [group.arrived[m][0] for m in members]
        assert group.task is not None
        error = ""
        for tries in range(self.retries + 1):
            try:
                rewards = await self._grade_once(group.task, results)
                for m, reward in zip(members, rewards, strict=True):
                    group.arrived[m][1].set_result(reward)
                return
            except GraderError as e:
                log.error("event=group_grader_error group=%s try=%d error=%s", key, tries, e)
                error = str(e)
        for m in members:
            group.arrived[m][1].set_exception(GraderError(error))

    async def _grade_once(self, task: Task, results: list[AttemptResult]) -> list[RewardIn]:
        call: Callable[[], list[RewardIn]] = lambda: self.grader.grade_group(task, results)  # noqa: E731
        try:
            async with asyncio.timeout(self.timeout_s):
                values = await asyncio.to_thread(call)
        except TimeoutError:
            raise GraderError(f"group grader ran past {self.timeout_s}s") from None
        except Exception as e:
            raise GraderError(f"group grader crashed: {type(e).__name__}: {e}") from e
        if not isinstance(values, list) or len(values) != len(results):
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise GraderError(f"group grader returned {got} rewards for a group of {len(results)}")
        out = []
        for value, result in zip(values, results, strict=True):
            try:
                reward = as_reward(value)
            except ValueError as e:
                raise GraderError(f"group grader returned an unusable reward: {e}") from e
            details = {"exit_code": result.exit_code, "timed_out": result.timed_out, **reward.details}
            out.append(reward.model_copy(update={"details": details}))
        return out
