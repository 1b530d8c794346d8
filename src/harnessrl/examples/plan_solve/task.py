"""Data and grader of the `plan_solve` example: the calc example's problems (same splits) and its exact
grader, the plan kept in the reward's details. One reward per attempt: it trains the planner's
adapter and the solver's alike (rollout-level advantage, docs/lora.md)."""

from __future__ import annotations

import json

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.calc import task as calc
from harnessrl.schema import RewardIn, Task

build_splits = calc.build_splits


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """1.0 if the solver's answer equals the reference number, else 0.0; the details add the plan."""
    reward = calc.grade(task, result)
    answer_file = result.output_dir / "answer.json"
    if answer_file.exists():
        try:
            reward.details["plan"] = str(json.loads(answer_file.read_text()).get("plan", ""))[:500]
        except (json.JSONDecodeError, AttributeError):
            reward.details["plan"] = None
    return reward
