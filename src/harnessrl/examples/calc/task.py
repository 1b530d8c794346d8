"""Data and grader of the `calc` example: arithmetic problems from `reasoning-gym`, generated offline
with fixed seeds; held-out problems never appear in the training split (deduplicated by text)."""

from __future__ import annotations

import json
import math
from typing import Any

from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, Task

GENERATOR = "basic_arithmetic"
GENERATOR_ARGS: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 3,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-", "*"],
    "allow_parentheses": False,
    "allow_negation": False,
    "format_style": "natural",
}


def _generate(n: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    return list(reasoning_gym.create_dataset(GENERATOR, size=n, seed=seed, **GENERATOR_ARGS))


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks; a held-out question never also appears in train."""
    train_items = _generate(n_train, seed=1000 + seed)
    seen = {x["question"] for x in train_items}
    train = [_task(x, f"train-{i}") for i, x in enumerate(train_items)]
    heldout: list[Task] = []
    for x in _generate(n_heldout * 3, seed=2000 + seed):
        if x["question"] not in seen:
            seen.add(x["question"])
            heldout.append(_task(x, f"heldout-{len(heldout)}"))
        if len(heldout) == n_heldout:
            break
    return train, heldout


def _task(item: dict[str, Any], task_id: str) -> Task:
    return Task(
        task_id=task_id, input={"question": item["question"]}, reference={"answer": str(item["answer"])}
    )


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """1.0 if the harness's reported answer equals the reference number, else 0.0."""
    expected = float(task.reference["answer"])
    answer_file = result.output_dir / "answer.json"
    if not answer_file.exists():
        return RewardIn(value=0.0, details={"reason": "no answer.json written", "expected": expected})
    out = json.loads(answer_file.read_text())
    answer = out.get("answer")
    try:
        correct = answer is not None and math.isclose(float(answer), expected, rel_tol=0, abs_tol=1e-6)
    except (TypeError, ValueError):
        correct = False
    return RewardIn(
        value=1.0 if correct else 0.0,
        details={"answer": answer, "expected": expected, "tool_calls": out.get("tool_calls", 0)},
    )
