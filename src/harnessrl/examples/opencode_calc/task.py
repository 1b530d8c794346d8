"""Tasks and grader of `opencode_calc`: the `calc` example's arithmetic problems (reasoning-gym,
generated offline with fixed seeds), graded on the answer file the agent wrote, else on the last number
OpenCode printed."""

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
    """1.0 if the answer equals the reference, else 0.0. The answer is the last number in `answer.txt`
    when the agent wrote that file with its `write` tool, else the last number OpenCode printed."""
    expected = float(task.reference["answer"])
    stdout = result.output_dir / "opencode_stdout.txt"
    if not stdout.exists():
        return RewardIn(
            value=0.0,
            details={"reason": "no opencode_stdout.txt (OpenCode did not run)", "expected": expected},
        )
    text = stdout.read_text(errors="replace")
    written = result.output_dir / "answer.txt"
    source = "answer.txt" if written.is_file() else "stdout"
    answer = last_number(written.read_text(errors="replace") if written.is_file() else text)
    correct = answer is not None and math.isclose(float(answer), expected, rel_tol=0, abs_tol=1e-6)
    return RewardIn(
        value=1.0 if correct else 0.0,
        details={"answer": answer, "source": source, "expected": expected, "exit_code": result.exit_code,
                 "text": text[-300:]},
    )  # fmt: skip
