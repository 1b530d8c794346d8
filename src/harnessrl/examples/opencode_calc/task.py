"""Tasks and grader of `opencode_calc`: the `calc` example's arithmetic problems (reasoning-gym,
generated offline with fixed seeds), graded on the last number OpenCode printed."""

from __future__ import annotations

import math
import re

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.calc.task import build_splits
from harnessrl.schema import RewardIn, Task

__all__ = ["build_splits", "grade", "last_number"]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in OpenCode's final answer (`The answer is 42.` → `42`)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """1.0 if the last number OpenCode printed equals the reference, else 0.0."""
    expected = float(task.reference["answer"])
    out = result.output_dir / "opencode_stdout.txt"
    if not out.exists():
        return RewardIn(value=0.0, details={"reason": "no opencode_stdout.txt (OpenCode did not run)", "expected": expected})
    text = out.read_text(errors="replace")
    answer = last_number(text)
    correct = answer is not None and math.isclose(float(answer), expected, rel_tol=0, abs_tol=1e-6)
    return RewardIn(
        value=1.0 if correct else 0.0,
        details={"answer": answer, "expected": expected, "exit_code": result.exit_code, "text": text[-300:]},
    )
