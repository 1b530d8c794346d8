"""The `plan_solve` harness: a planner and a solver, two roles of one agent on the official `openai` SDK.

Per attempt it makes a **planner** call (model name `planner`: a one-line plan for the question, no
tools) and then runs the calc harness's tool loop as the **solver** (model name `solver`: the question
and the plan, the calculator tool). The model names are the only thing that tells the roles apart: a
run with `policies: {planner: ..., solver: ...}` serves and trains each role with its own adapter.
It reads the harness contract (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `HARNESSRL_TASK`,
`HARNESSRL_OUTPUT`) and writes `answer.json` (the answer, the plan, the solver's text, its tool calls).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from openai import OpenAI

from harnessrl.examples.calc.harness import solve

PLANNER_MODEL = "planner"
SOLVER_MODEL = "solver"
PLAN_TOKENS = 48
PLANNER_SYSTEM = (
    "You plan arithmetic for a solver that has a calculator. Reply with one short line: "
    "the expression the solver should compute."
)
# Two worked plans shown as earlier turns, as the calc harness shows worked tool calls.
PLANNER_EXAMPLES: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 12 + 7 * 3?"},
    {"role": "assistant", "content": "Compute 12 + 7 * 3 with the calculator."},
    {"role": "user", "content": "Compute 45 - 18."},
    {"role": "assistant", "content": "Compute 45 - 18 with the calculator."},
]


def plan(client: OpenAI, question: str) -> str:
    """The planner's call: a one-line plan for `question` (its text, empty if it wrote none)."""
    messages = [{"role": "system", "content": PLANNER_SYSTEM}, *PLANNER_EXAMPLES]
    messages.append({"role": "user", "content": question})
    resp = client.chat.completions.create(model=PLANNER_MODEL, messages=messages, max_tokens=PLAN_TOKENS)  # type: ignore[arg-type]
    return (resp.choices[0].message.content or "").strip()


def plan_and_solve(client: OpenAI, question: str) -> dict[str, Any]:
    """One attempt: the planner's plan, then the solver's tool loop on the question and the plan."""
    the_plan = plan(client, question)
    out = solve(client, f"{question}\nPlan: {the_plan}", model=SOLVER_MODEL)
    return {**out, "plan": the_plan}


def main() -> int:
    """Entry point: plan and solve the task in $HARNESSRL_TASK, write $HARNESSRL_OUTPUT/answer.json."""
    if "HARNESSRL_TASK" not in os.environ:
        print("error: HARNESSRL_TASK is not set; the controller starts this harness", file=sys.stderr)
        return 2
    task = json.loads(Path(os.environ["HARNESSRL_TASK"]).read_text())
    out = plan_and_solve(OpenAI(max_retries=5, timeout=600), task["question"])
    Path(os.environ["HARNESSRL_OUTPUT"], "answer.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
