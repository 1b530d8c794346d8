"""The `calc_chain` example: generated chains, the per-step grader, the harness's chain loop, and one
real episode of the harness through a real gateway and engine (tiny random model, real tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples import get_example
from harnessrl.examples.calc import harness
from harnessrl.examples.calc_chain.task import MAX_STEPS, MIN_STEPS, apply, build_splits, describe, grade
from harnessrl.schema import RolloutState, Task
from tests.support.gateway import GatewayHandle, run_example_episode


def test_generation_is_deterministic_disjoint_and_spans_the_step_range() -> None:
    train, held = build_splits(500, 60, seed=0)
    train2, held2 = build_splits(500, 60, seed=0)
    assert [t.model_dump() for t in train + held] == [t.model_dump() for t in train2 + held2]
    _, held_small = build_splits(10, 60, seed=0)
    assert [t.input for t in held_small] == [t.input for t in held]  # held-out does not depend on n_train
    key = lambda t: json.dumps(t.input, sort_keys=True)  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in held}
    assert {len(t.input["steps"]) for t in train} == set(range(MIN_STEPS, MAX_STEPS + 1))
    for t in train + held:
        assert "ops" not in t.input  # the harness sees the wording, not the reference
        assert t.input["steps"] == [describe((k, a, b)) for k, a, b in t.reference["ops"]]
    assert build_splits(5, 5, seed=1)[0][0].input != train[0].input


def test_step_wording_and_arithmetic() -> None:
    assert describe(("add", 17, 1)) == "Add 17." and apply(("add", 17, 1), 3) == 20
    assert describe(("sub_mul", 4, 6)) == "Subtract 4 * 6." and apply(("sub_mul", 4, 6), 10) == -14
    assert harness.evaluate("10 - 4 * 6") == apply(("sub_mul", 4, 6), 10)  # the calculator agrees
    with pytest.raises(ValueError, match="unknown step kind"):
        apply(("div", 1, 1), 0)


def _result(tmp_path: Path, out: object | None) -> AttemptResult:
    d = tmp_path / "output"
    d.mkdir(exist_ok=True)
    (d / "answer.json").unlink(missing_ok=True)
    if out is not None:
        (d / "answer.json").write_text(json.dumps(out))
    return AttemptResult(exit_code=0, timed_out=False, output_dir=d, stdout_tail="", stderr_tail="")


TASK = Task(
    task_id="t",
    input={"start": 10, "steps": ["Add 5.", "Subtract 2 * 3.", "Add 1."]},
    reference={"start": 10, "ops": [["add", 5, 1], ["sub_mul", 2, 3], ["add", 1, 1]]},
)


def test_grader_scores_each_step_on_the_total_the_harness_showed(tmp_path: Path) -> None:
    perfect = grade(TASK, _result(tmp_path, {"answers": ["15", "9", "10"], "tool_calls": 3}))
    assert perfect.value == 1.0 and perfect.details["chain_correct"] and perfect.details["tool_calls"] == 3
    # Step 2 wrong (8 instead of 9): step 3 is judged on the 8 the harness then showed, so 8 + 1 = 9 is right.
    one_wrong = grade(TASK, _result(tmp_path, {"answers": ["15", "8", "9"]}))
    assert one_wrong.value == pytest.approx(2 / 3) and not one_wrong.details["chain_correct"]
    assert grade(TASK, _result(tmp_path, {"answers": ["15", "8", "10"]})).value == pytest.approx(1 / 3)
    # The harness stopped after an answer without a number: unreached steps count as wrong.
    stopped = grade(TASK, _result(tmp_path, {"answers": ["15", None]}))
    assert stopped.value == pytest.approx(1 / 3) and stopped.details["reached"] == 2
    assert grade(TASK, _result(tmp_path, {"answers": ["15.0", "9.00", "10"]})).value == 1.0
    assert grade(TASK, _result(tmp_path, {"answers": ["15", "9.5", "10.5"]})).value == pytest.approx(2 / 3)
    assert grade(TASK, _result(tmp_path, {"answers": ["15", "9", "10", "99"]})).value == 1.0  # extra ignored
    for bad in ({"answers": "15"}, {"answer": "15"}, {"answers": []}, {"answers": ["nan", "inf", "x"]}):
        assert grade(TASK, _result(tmp_path, bad)).value == 0.0
    missing = grade(TASK, _result(tmp_path, None))
    assert missing.value == 0.0 and missing.details["reason"] == "no answer.json written"


def test_grader_gives_each_call_of_a_step_that_steps_reward(tmp_path: Path) -> None:
    # step 1 right in 2 calls, step 2 wrong in 1 call, step 3 right (on the 8 shown) in 3 calls
    graded = grade(TASK, _result(tmp_path, {"answers": ["15", "8", "9"], "calls_per_step": [2, 1, 3]}))
    assert graded.value == pytest.approx(2 / 3)  # the rollout's reward is unchanged by step rewards
    assert [(s.call, s.value) for s in graded.steps] == [
        (0, 1.0),
        (1, 1.0),
        (2, 0.0),
        (3, 1.0),
        (4, 1.0),
        (5, 1.0),
    ]
    stopped = grade(TASK, _result(tmp_path, {"answers": ["15", None], "calls_per_step": [1, 4]}))
    assert [(s.call, s.value) for s in stopped.steps] == [(0, 1.0), (1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]
    for bad in (None, "2,1,3", [2, 1], [2, "1", 3], [2, -1, 3], [2, 1, 999]):  # no count to trust: no steps
        assert (
            grade(TASK, _result(tmp_path, {"answers": ["15", "9", "10"], "calls_per_step": bad})).steps == []
        )


class _ScriptedCompletions:
    """Stands in for `client.chat.completions`: answers each request from a script, records requests."""

    def __init__(self, replies: list[str]) -> None:
        self.replies, self.requests = list(replies), []  # type: ignore[var-annotated]

    def create(self, **request: Any) -> Any:
        self.requests.append({**request, "messages": list(request["messages"])})  # the harness appends later
        msg = SimpleNamespace(content=self.replies.pop(0), tool_calls=None)
        msg.model_dump = lambda exclude_none=True: {"role": "assistant", "content": msg.content}
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


def test_chain_loop_carries_the_models_answer_and_stops_without_a_number() -> None:
    completions = _ScriptedCompletions(["The answer is 15.", "It is 8.", "no idea", "unused"])
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    out = harness.solve_chain(client, 10, TASK.input["steps"] + ["Add 2."])  # type: ignore[arg-type]
    assert out == {"answers": ["15", "8", None], "tool_calls": 0, "steps": 4, "calls_per_step": [1, 1, 1]}
    questions = [r["messages"][-1]["content"] for r in completions.requests]
    assert questions == [
        "The total is 10. Add 5. What is the new total?",
        "The total is 15. Subtract 2 * 3. What is the new total?",
        "The total is 8. Add 1. What is the new total?",  # the model's (wrong) answer, carried on
    ]
    # Every step is a fresh conversation: system prompt, the chain's worked examples, one question.
    assert all(r["messages"][1:-1] == harness.CHAIN_EXAMPLES for r in completions.requests)


async def test_harness_runs_one_real_chain(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    """The real harness as a subprocess, through a real gateway to the engine's tiny random model."""
    gw = make_gateway()
    _, held = get_example("calc_chain").build_splits(0, 1, 0)
    outcome, out = await run_example_episode("calc_chain", gw, held[0], "chain-e2e", tmp_path / "run")
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward is not None
    assert out["steps"] == len(held[0].input["steps"]) and 1 <= len(out["answers"]) <= out["steps"]
    calls = gw.store.calls(outcome.rollout_id)
    assert len(calls) >= len(out["answers"]) and all(c.completion_ids for c in calls)
    assert len(calls) == sum(out["calls_per_step"])  # the harness's count is the gateway's
    reward = gw.store.get_reward(outcome.rollout_id)
    assert reward is not None and reward.details["reached"] == len(out["answers"])
    assert [s.call for s in reward.steps] == list(
        range(len(calls))
    )  # every recorded call has its step's reward
