"""Data and grader of the `calc_chain` example.

A task is a start value and 1 to 10 steps ("Add 17.", "Subtract 9.", "Add 7 * 3.", "Subtract 4 * 6.").
The harness shows the model "The total is T. <step> What is the new total?", T being the model's own
previous answer (the start for the first step), and reports every answer. The grader checks each step
against the total the harness showed, so one wrong step costs that step only:
reward = correct steps / steps (a step the harness never reached counts as wrong). Step rewards
(`train.credit: step`, docs/credit.md): each model call of a reached step gets 1 if that step's answer
was right, else 0, named by position from the harness's `calls_per_step`; the rollout's reward is the
same either way. Generated with a fixed seed; a held-out task never also appears in train.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from harnessrl.controller.runner import AttemptResult
from harnessrl.schema import RewardIn, StepReward, Task

MIN_STEPS, MAX_STEPS = 1, 10
Op = tuple[str, int, int]  # (kind, a, b): b is 1 for "add"/"sub"


def apply(op: Op, total: float) -> float:
    """The new total after one step."""
    kind, a, b = op
    if kind in ("add", "add_mul"):
        return total + a * b
    if kind in ("sub", "sub_mul"):
        return total - a * b
    raise ValueError(f"unknown step kind {kind!r}")


def describe(op: Op) -> str:
    """A step as the harness words it."""
    kind, a, b = op
    amount = f"{a} * {b}" if kind.endswith("_mul") else str(a)
    return f"{'Add' if kind.startswith('add') else 'Subtract'} {amount}."


def _make(rnd: random.Random) -> tuple[int, list[Op]]:
    start = rnd.randint(1, 99)
    ops: list[Op] = []
    for _ in range(rnd.randint(MIN_STEPS, MAX_STEPS)):
        kind = rnd.choice(["add", "sub", "add_mul", "sub_mul"])
        if kind.endswith("_mul"):
            ops.append((kind, rnd.randint(2, 12), rnd.randint(2, 9)))
        else:
            ops.append((kind, rnd.randint(1, 99), 1))
    return start, ops


def _task(start: int, ops: list[Op], task_id: str) -> Task:
    return Task(
        task_id=task_id,
        input={"start": start, "steps": [describe(op) for op in ops]},
        reference={"start": start, "ops": [list(op) for op in ops]},
    )


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks (the held-out set does not depend on n_train)."""
    rnd = random.Random(1000 + seed)
    train_items = [_make(rnd) for _ in range(n_train)]
    seen = {json.dumps(x) for x in train_items}
    train = [_task(s, ops, f"train-{i}") for i, (s, ops) in enumerate(train_items)]
    heldout: list[Task] = []
    rnd = random.Random(2000 + seed)
    while len(heldout) < n_heldout:
        item = _make(rnd)
        if json.dumps(item) not in seen:
            seen.add(json.dumps(item))
            heldout.append(_task(item[0], item[1], f"heldout-{len(heldout)}"))
    return train, heldout


def _number(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """Fraction of steps whose answer equals the step applied to the total the harness showed."""
    start = float(task.reference["start"])
    ops: list[Op] = [(str(k), int(a), int(b)) for k, a, b in task.reference["ops"]]
    answer_file = result.output_dir / "answer.json"
    if not answer_file.exists():
        return RewardIn(value=0.0, details={"reason": "no answer.json written", "steps": len(ops)})
    out = json.loads(answer_file.read_text())
    answers = out.get("answers")
    if not isinstance(answers, list):
        return RewardIn(value=0.0, details={"reason": "answer.json has no list 'answers'", "steps": len(ops)})
    shown, correct = start, []
    for op, answer in zip(ops, answers, strict=False):
        value = _number(answer)
        correct.append(value is not None and math.isclose(value, apply(op, shown), rel_tol=0, abs_tol=1e-6))
        if value is None:
            break
        shown = value
    n_right = sum(correct)
    return RewardIn(
        value=n_right / len(ops),
        steps=step_rewards(correct, out.get("calls_per_step")),
        details={"steps": len(ops), "reached": len(correct), "correct": n_right,
                 "chain_correct": n_right == len(ops), "tool_calls": out.get("tool_calls", 0),
                 "calls_per_step": out.get("calls_per_step")},  # step credit pairs calls by step
    )  # fmt: skip


def step_rewards(correct: list[bool], calls_per_step: Any) -> list[StepReward]:
    """One step reward per model call of each reached step: 1 if the step was right, else 0; none when
    the harness did not say how many calls each step made (or said something that does not fit)."""
    if (
        not isinstance(calls_per_step, list)
        or len(calls_per_step) < len(correct)
        or not all(isinstance(n, int) and 0 <= n <= 64 for n in calls_per_step)
    ):
        return []
    out: list[StepReward] = []
    call = 0
    for right, n in zip(correct, calls_per_step, strict=False):
        out += [StepReward(call=call + k, value=1.0 if right else 0.0) for k in range(n)]
        call += n
    return out
