"""Graders run in the controller, outside the harness process: a task's result becomes a reward."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, Task


class Grader(Protocol):
    """Turns a finished attempt of a task into a reward."""

    def __call__(self, task: Task, result: AttemptResult) -> RewardIn | float: ...


class GraderError(Exception):
    """The grader crashed or ran past its time limit."""


async def grade(
    grader: Grader | Callable[[Task, AttemptResult], RewardIn | float],
    task: Task,
    result: AttemptResult,
    timeout_s: float = 60.0,
) -> RewardIn:
    """Run a grader in a worker thread with a time limit; its crash becomes `GraderError`."""
    try:
        value = await asyncio.wait_for(asyncio.to_thread(grader, task, result), timeout=timeout_s)
    except TimeoutError:
        raise GraderError(f"grader ran past {timeout_s}s") from None
    except Exception as e:
        raise GraderError(f"grader crashed: {type(e).__name__}: {e}") from e
    reward = value if isinstance(value, RewardIn) else RewardIn(value=float(value))
    details = dict(reward.details)
    details.setdefault("exit_code", result.exit_code)
    details.setdefault("timed_out", result.timed_out)
    return reward.model_copy(update={"details": details})
