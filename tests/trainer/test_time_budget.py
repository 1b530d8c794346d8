"""`train.time_budget_s` in the RL loop, end to end (engine + gateway processes, the real calc harness, a
tiny random model): a run the budget stops between two `checkpoint_every` multiples saves the step it
stopped after, says so in its summary, and `--resume` continues from exactly that step to `train.steps`;
the sync and async schedules alike. And the budget's validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.config import ConfigError, load_config
from harnessrl.examples import get_example
from harnessrl.runs.flow import run
from harnessrl.runs.summary import stop_note


def _overrides(run_dir: Path, model: Path, schedule: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"engine.model={model}",
        "engine.max_batch=8",
        "engine.threads=1",
        f"train.schedule={schedule}",
        "train.steps=3",
        "train.batch_groups=1",
        "train.group_size=2",
        "train.max_inflight_groups=2",
        "train.checkpoint_every=2",  # the budget stops after step 1: not a multiple, not the last
        "train.keep_checkpoints=2",
        "train.lr=1e-3",
        "controller.concurrency=4",
        "eval.n_heldout=1",
        "eval.extra_temperatures=[]",
        "data.n_train=30",
        "gateway.default_max_tokens=16",
    ]


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_budget_stop_saves_its_step_and_resume_continues_from_it(
    tiny_model_dir: Path, tmp_path: Path, schedule: str
) -> None:
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, tiny_model_dir, schedule)
    # a budget any step outlasts: the run stops after its first step
    cfg = load_config(get_example("calc").config_path, [*overrides, "train.time_budget_s=0.001"])
    seen: list[int] = []
    summary = run(cfg, fresh=True, check=False, on_step=lambda step, m: seen.append(step))
    assert seen == [1] and summary["train_steps"] == 1
    assert (summary["steps_planned"], summary["stopped_early"], summary["time_budget_s"]) == (3, True, 0.001)
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "step-1")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1"]
    state = json.loads((run_dir / "checkpoints" / "step-1" / "state.json").read_text())
    assert state["step"] == 1
    if schedule == "async":  # the groups in flight at the stop are in the checkpoint, to be run again
        assert state["next_group"] >= 2 and state["pending_groups"]
    log = (run_dir / "harnessrl.log").read_text()
    assert "event=time_budget_stop step=1 of=3" in log
    line = stop_note(summary, "harnessrl train --resume")
    assert line is not None and "ran out after step 1 of 3" in line and "step-1" in line
    assert "harnessrl train --resume" in line

    # --resume (the budget lifted, as a resume may) continues from step 1, not from scratch
    cfg = load_config(get_example("calc").config_path, [*overrides, "train.time_budget_s=null"])
    seen.clear()
    resumed = run(cfg, resume=True, check=False, on_step=lambda step, m: seen.append(step))
    assert seen == [2, 3] and resumed["train_steps"] == 3 and not resumed["stopped_early"]
    assert stop_note(resumed, "harnessrl train --resume") is None
    assert "event=resumed step=1" in (run_dir / "harnessrl.log").read_text()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["weight_version"] for r in records] == [1, 2, 3]
    # every 2nd and the last; keep_checkpoints 2 pruned step-1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-3"]


def test_a_budget_stop_without_checkpoints_says_a_resume_starts_over() -> None:
    """`train.checkpoint_every: 0` saves nothing, also at a budget stop: the note says --resume has
    nothing to continue from."""
    summary = {"train_steps": 4, "steps_planned": 10, "stopped_early": True, "time_budget_s": 60.0,
               "checkpoint": None}  # fmt: skip
    line = stop_note(summary, "harnessrl train --resume")
    assert line is not None and "ran out after step 4 of 10" in line and "checkpoint_every 0" in line
    assert "harnessrl train --resume" not in line


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_time_budget_must_be_positive(value: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.time_budget_s"):
        load_config(None, [f"train.time_budget_s={value}"])
    assert load_config(None, ["train.time_budget_s=null"]).train.time_budget_s is None
