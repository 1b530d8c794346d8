"""The whole loop with sharded trainer ranks (`train.world_size: 2`, `train.parallel: fsdp`): rollouts,
a sharded update, the gathered weights pushed to the engine, a checkpoint; then the run resumed from that
checkpoint by one trainer process (another world size), which trains the next step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.runs.flow import run


@pytest.mark.slow  # about 2 minutes: pytest -m slow tests/trainer/test_fsdp_e2e.py
def test_calc_loop_on_two_sharded_ranks_then_resumed_by_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"engine.model={tiny_model_dir}", "engine.max_batch=8",
        "engine.max_model_len=2048", "engine.threads=1", "train.steps=1", "train.batch_groups=2",
        "train.group_size=3", "train.checkpoint_every=1", "train.lr=1e-3", "train.world_size=2",
        "train.parallel=fsdp", "train.threads=1", "controller.concurrency=6", "eval.n_heldout=2",
        "data.n_train=30", "gateway.default_max_tokens=16", "eval.extra_temperatures=[]",
    ]  # fmt: skip
    summary = run(load_config(get_example("calc").config_path, overrides), fresh=True)
    run_dir = tmp_path / "run"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["train_steps"] == 1 and records[0]["ranks"] == 2 and records[0]["weight_version"] == 1
    assert records[0]["rollouts_failed"] == 0
    rank1 = (run_dir / "logs" / "trainer-rank1.log").read_text()
    assert "parallel=fsdp" in rank1 and "event=rank_update rank=1" in rank1
    assert (run_dir / "checkpoints" / "step-1" / "optimizer.pt").exists()

    one_rank = [*[o for o in overrides if not o.startswith("train.world_size")], "train.steps=2"]
    seen: list[int] = []
    summary2 = run(load_config(get_example("calc").config_path, one_rank), resume=True,
                   on_step=lambda step, m: seen.append(step))  # fmt: skip
    assert seen == [2] and summary2["train_steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "ranks" not in records[-1]
