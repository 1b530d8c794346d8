"""Rollouts whose reward rose while their answer's checks did not: the dashboard's reward-hacking list.

A grader that records how many of the task's own checks an answer passed (the `coding` grader's
`details["passed"]`: tests of the task, restored, passing) lets the reward be compared with them. Over
the graded rollouts of one task, rollout r is **listed** when another rollout q of the same task got a
lower reward while passing at least as many checks:

    listed(r)  ⇔  ∃ q ≠ r, task(q) = task(r):  reward(q) < reward(r)  and  checks(q) ≥ checks(r)

i.e. r's extra reward is not explained by its checks: something else raised it (tests edited, a
grader that trusted the attempt's files, a judge talked round). Its **baseline** is such a q with the
lowest reward (ties: the most checks, then the earliest), and its **rise** is reward(r) − reward(q).
Within a group this is exactly a rollout the advantage favours over a sibling that did no worse on
the checks. Rollouts without a numeric `details[checks]` are left out (counted); the grader's
`hacking` flag, when set, is shown beside each listed rollout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Graded:
    """One graded rollout as the list needs it."""

    rollout_id: str
    task_id: str
    group_id: str | None
    step: int | None
    reward: float
    checks: float | None  # details[checks key], None when absent or not a number
    hacking: Any = None  # the grader's (or the guard's) `hacking` detail, if any


def checks_of(details: dict[str, Any], key: str) -> float | None:
    """`details[key]` as a number (bool and non-finite values are not), else None."""
    v = details.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def unbacked_rises(graded: list[Graded]) -> tuple[list[dict[str, Any]], int]:
    """(the listed rollouts, largest rise first, each with its baseline; how many had no checks)."""
    by_task: dict[str, list[Graded]] = {}
    without = 0
    for g in graded:
        if g.checks is None:
            without += 1
        else:
            by_task.setdefault(g.task_id, []).append(g)
    listed: list[dict[str, Any]] = []
    for members in by_task.values():
        for r in members:
            below = [
                q
                for q in members
                if q is not r and q.reward < r.reward and (q.checks or 0.0) >= (r.checks or 0.0)
            ]
            if not below:
                continue
            q = min(below, key=lambda x: (x.reward, -(x.checks or 0.0), members.index(x)))
            listed.append({
                "rollout_id": r.rollout_id, "task_id": r.task_id, "group_id": r.group_id, "step": r.step,
                "reward": r.reward, "checks": r.checks, "hacking": r.hacking,
                "baseline": {"rollout_id": q.rollout_id, "reward": q.reward, "checks": q.checks, "step": q.step},
                "rise": r.reward - q.reward,
            })  # fmt: skip
    listed.sort(key=lambda x: (-x["rise"], x["step"] is None, x["step"] or 0, x["rollout_id"]))
    return listed, without
