"""Graders run in the controller, outside the harness process: a task's result becomes a reward."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

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
        async with asyncio.timeout(timeout_s):
            value = await asyncio.to_thread(grader, task, result)
    except TimeoutError:
        raise GraderError(f"grader ran past {timeout_s}s") from None
    except Exception as e:
        raise GraderError(f"grader crashed: {type(e).__name__}: {e}") from e
    try:
        reward = as_reward(value)
    except ValueError as e:  # pydantic's ValidationError: details that are not JSON
        raise GraderError(f"grader returned an unusable reward: {e}") from e
    details = dict(reward.details)
    details.setdefault("exit_code", result.exit_code)
    details.setdefault("timed_out", result.timed_out)
    return reward.model_copy(update={"details": details})


def as_reward(value: Any) -> RewardIn:
    """A grader's return value as a reward: a number, `(number, details)` or `RewardIn`. Anything
    else, or a value that is not finite, is a grader error (never a silent 0 or NaN)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = RewardIn(value=_number(value[0]), details=value[1])
    elif not isinstance(value, RewardIn):
        value = RewardIn(value=_number(value))
    if not math.isfinite(value.value):
        raise GraderError(f"grader returned a reward that is not finite: {value.value}")
    return value


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise GraderError(
            f"grader returned {type(v).__name__} {str(v)[:80]!r}; return a float, (float, details) or RewardIn"
        )
    return float(v)


class CommandGrader:
    """A grader that is a command: it runs outside the harness with a time limit, gets the task (JSON
    file, reference included) and the attempt's output directory, and prints its reward on the last
    line of stdout — a number, or a JSON object `{"value": ..., "details": {...}}`. A non-zero exit, a
    timeout or an unreadable last line is a grader crash (`GraderError` once wrapped by `grade`).

    The command gets `HARNESSRL_GRADE_TASK` (the task file), `HARNESSRL_OUTPUT` (the attempt's output
    directory), `HARNESSRL_EXIT_CODE` and `HARNESSRL_TIMED_OUT` in its environment."""

    def __init__(
        self, command: list[str], timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> None:
        self.command, self.timeout_s, self.env = command, timeout_s, env or {}

    def __call__(self, task: Task, result: AttemptResult) -> RewardIn:
        """Run the command on one finished attempt and parse its reward."""
        with tempfile.TemporaryDirectory(prefix="harnessrl-grade-") as tmp:
            task_file = Path(tmp) / "task.json"
            task_file.write_text(task.model_dump_json())
            env = {
                **os.environ,
                **self.env,
                "HARNESSRL_GRADE_TASK": str(task_file),
                "HARNESSRL_OUTPUT": str(result.output_dir),
                "HARNESSRL_EXIT_CODE": "" if result.exit_code is None else str(result.exit_code),
                "HARNESSRL_TIMED_OUT": "1" if result.timed_out else "0",
            }
            try:
                proc = subprocess.run(self.command, env=env, capture_output=True, text=True,
                                      timeout=self.timeout_s, cwd=tmp, check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"grader command ran past {self.timeout_s}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"grader command exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise RuntimeError("grader command printed no reward")
        return parse_reward(lines[-1])


def parse_reward(line: str) -> RewardIn:
    """A reward from a grader command's last line: a number or `{"value": ..., "details": {...}}`."""
    try:
        parsed = json.loads(line)
    except json.JSONDecodeError:
        raise RuntimeError(f"grader command's last line is not a reward: {line[:200]!r}") from None
    if isinstance(parsed, int | float) and not isinstance(parsed, bool):
        return RewardIn(value=float(parsed))
    if isinstance(parsed, dict):
        return RewardIn.model_validate(parsed)
    raise RuntimeError(f"grader command's last line is not a reward: {line[:200]!r}")
