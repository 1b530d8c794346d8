"""The whole loop end to end: engine + gateway processes, the real calc harness as subprocesses,
the grader, the adapter and PPO on a tiny random model with the real tokenizer; then a resume."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.runs.flow import run
from harnessrl.store import SQLiteStore


def test_demo_loop_runs_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"engine.model={tiny_model_dir}",
        "engine.max_batch=8",
        "engine.max_model_len=2048",
        "engine.threads=1",
        "train.steps=2",
        "train.batch_groups=2",
        "train.group_size=3",
        "train.checkpoint_every=1",
        "train.lr=1e-3",
        "train.engine_sleep_level=2",  # collocation: weights discarded during each update, reloaded after
        "controller.concurrency=6",
        "eval.n_heldout=4",
        "data.n_train=30",
        "gateway.default_max_tokens=16",
        "eval.temperature=0.0",
        "eval.extra_temperatures=[1.0]",
        "eval.every=1",  # a held-out evaluation after step 1 too (not after the last step: that is "after")
    ]
    cfg = load_config(get_example("calc").config_path, overrides)
    seen: list[int] = []
    summary = run(cfg, fresh=True, on_step=lambda step, m: seen.append(step))
    run_dir = tmp_path / "run"
    for key in (
        "heldout_reward_before",
        "heldout_reward_after",
        "n_heldout",
        "train_steps",
        "wall_seconds",
        "merge_rate",
    ):
        assert key in summary
    assert summary["n_heldout"] == 4 and summary["train_steps"] == 2 and seen == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["train_steps"] == 2
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert list((run_dir / "tensorboard").iterdir())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert "heldout_reward" in records[0] and "heldout_reward" not in records[1]
    lo, hi = records[0]["heldout_ci95"]
    assert 0 <= lo <= records[0]["heldout_reward"] <= hi <= 1 and records[0]["time_eval_s"] > 0
    assert summary["heldout_curve"] == [
        [0, summary["heldout_reward_before"]],
        [1, records[0]["heldout_reward"]],
        [2, summary["heldout_reward_after"]],
    ]
    assert 0 < summary["eval_during_train_seconds"] < summary["wall_seconds"] - summary["train_wall_seconds"]
    for r in records:
        assert r["rollouts"] == 6 and r["rollouts_failed"] == 0 and r["trainable_tokens"] > 0
        assert r["weight_version"] == r["step"]
    # every training call carries the weight version that served it: 0 in step 1, 1 in step 2
    store = SQLiteStore(run_dir / "store.sqlite")
    versions_by_step: dict[int, set[int | None]] = {}
    for ro in store.list_rollouts(limit=1000)[0]:
        if "step" in ro.metadata:
            for call in store.calls(ro.rollout_id):
                versions_by_step.setdefault(ro.metadata["step"], set()).add(call.weight_version)
    assert versions_by_step == {0: {0}, 1: {1}}
    engine_log = next((run_dir / "logs").glob("engine*.log")).read_text()
    assert engine_log.count("event=engine_sleep_level_2") == engine_log.count("event=engine_wake") == 2
    # each update's weights went from memory, through shared memory (engine.weight_sync: memory): no folder
    assert engine_log.count("event=weights_mapped") == 2 and not (run_dir / "weights").exists()
    harness_runs = list((run_dir / "rollouts").glob("*/attempt-0/output/answer.json"))
    # every rollout ran the real harness: training, evaluations before and after (2 temperatures),
    # the one after step 1, and the preflight attempt before anything else
    assert len(harness_runs) == 2 * 6 + 2 * 2 * 4 + 4 + 1
    assert set(summary["heldout_by_temperature"]) == {"0", "1"}
    store.close()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2"]

    # resume: one more step continues from the step-2 checkpoint, reusing the finished evaluations
    cfg3 = load_config(get_example("calc").config_path, [*overrides, "train.steps=3"])
    seen.clear()
    summary3 = run(cfg3, resume=True, on_step=lambda step, m: seen.append(step))
    assert seen == [3] and summary3["train_steps"] == 3
    assert summary3["heldout_reward_before"] == summary["heldout_reward_before"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["weight_version"] == 3
