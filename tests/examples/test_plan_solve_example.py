"""The `plan_solve` example's grader (the calc grader, the plan in its details) and its config (two
policies on LoRA, each chosen by the model name its harness sends)."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl.config import load_config
from harnessrl.controller.runner import AttemptResult
from harnessrl.examples import example_config
from harnessrl.examples.plan_solve import harness
from harnessrl.examples.plan_solve.task import grade
from harnessrl.schema import Task

TASK = Task(task_id="t", input={"question": "What is 6 - 5 + 1?"}, reference={"answer": "2"})


def _result(tmp_path: Path, out: object | None) -> AttemptResult:
    d = tmp_path / "output"
    d.mkdir(parents=True, exist_ok=True)
    if out is not None:
        (d / "answer.json").write_text(json.dumps(out))
    return AttemptResult(exit_code=0, timed_out=False, output_dir=d, stdout_tail="", stderr_tail="")


def test_the_grader_scores_the_solver_and_keeps_the_plan(tmp_path: Path) -> None:
    right = grade(TASK, _result(tmp_path, {"answer": "2", "plan": "Compute 6 - 5 + 1.", "tool_calls": 1}))
    assert right.value == 1.0 and right.details["plan"] == "Compute 6 - 5 + 1."
    wrong = grade(TASK, _result(tmp_path, {"answer": "3", "plan": "guess"}))
    assert wrong.value == 0.0 and wrong.details["plan"] == "guess"
    assert grade(TASK, _result(tmp_path / "none", None)).value == 0.0


def test_the_config_has_a_policy_per_model_name_the_harness_sends() -> None:
    cfg = load_config(example_config("plan_solve"))
    assert cfg.train.lora is not None
    assert cfg.policy_models() == {"planner": ["planner"], "solver": ["solver"]}
    assert (harness.PLANNER_MODEL, harness.SOLVER_MODEL) == ("planner", "solver")
