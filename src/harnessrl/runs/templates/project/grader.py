"""The grader: runs outside the harness, after each attempt, and turns its output into a reward.

`grade(task, result)` gets the task (with its `reference`, which the harness never sees) and the
attempt's result (`result.output_dir`, `result.exit_code`, `result.timed_out`, `result.stderr_tail`).
It returns a float, or (float, details): the details are stored with the reward.
"""

from __future__ import annotations

import json
from typing import Any


def grade(task: Any, result: Any) -> tuple[float, dict[str, Any]]:
    """1.0 when the harness's answer equals the reference product, else 0.0."""
    expected = float(task.reference["answer"])
    answer_file = result.output_dir / "answer.json"
    if not answer_file.exists():
        return 0.0, {"reason": "no answer.json", "exit_code": result.exit_code}
    answer = json.loads(answer_file.read_text()).get("answer")
    try:
        correct = answer is not None and abs(float(answer) - expected) < 1e-6
    except (TypeError, ValueError):
        correct = False
    return (1.0 if correct else 0.0), {"answer": answer, "expected": expected}
