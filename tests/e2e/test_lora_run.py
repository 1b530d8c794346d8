"""A whole run with `train.lora`: engine + gateway processes, the real calc harness, PPO on a tiny random
model. The engine is sent adapters only and serves them (each call records the version that served
it), the model's own weights never move, and every checkpoint holds a PEFT adapter folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.modeling.loading import load_state_dict_file
from harnessrl.modeling.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from harnessrl.runs.flow import run
from harnessrl.store import SQLiteStore
from harnessrl.trainer.export_model import export_model

# A tiny random model never answers right, so every group would be zero-variance and nothing would
# train: this grader spreads rewards over a group by the attempt's output folder (unique per rollout).
GRADER = """
import zlib

def grade(task, result):
    return (zlib.crc32(str(result.output_dir).encode()) % 1000) / 1000
"""


@pytest.mark.slow  # tests/e2e/test_policies_run.py runs the LoRA loop in the suite; `pytest -m slow` runs this
def test_lora_run_trains_and_serves_the_adapter(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "spread_grader.py").write_text(GRADER)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [
        "grader.python=spread_grader:grade",
        f"run_dir={tmp_path / 'run'}", f"engine.model={tiny_model_dir}", "engine.max_batch=4",
        "engine.max_model_len=2048", "engine.threads=1", "train.steps=2", "train.batch_groups=2",
        "train.group_size=3", "train.checkpoint_every=1", "train.keep_checkpoints=2", "train.lr=5e-2",
        "train.lora.r=4", "train.lora.target_modules=[q_proj, v_proj, down_proj]", "controller.concurrency=4",
        "eval.n_heldout=2", "data.n_train=20", "gateway.default_max_tokens=12",
    ]  # fmt: skip
    cfg = load_config(get_example("calc").config_path, overrides)
    summary = run(cfg, fresh=True)
    run_dir = tmp_path / "run"
    assert summary["train_steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in records] == [1, 2]
    assert all(r["grad_norm"] > 0 and r["zero_adv_rows"] == 0 for r in records)
    # the engine was sent the adapter only: the last published version is a PEFT folder
    assert sorted(p.name for p in (run_dir / "weights" / "v2").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    adapter = load_file(str(run_dir / "checkpoints" / "step-2" / "adapter" / ADAPTER_WEIGHTS))
    assert len(adapter) == 2 * 3 * 2  # A and B of three projections in each of the tiny model's 2 layers
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)  # B moved from 0
    config = json.loads((run_dir / "checkpoints" / "step-2" / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tiny_model_dir)
    assert not (
        run_dir / "checkpoints" / "step-2" / "model.safetensors"
    ).exists()  # the adapter, no merged copy
    merged = load_state_dict_file(export_model(run_dir, tmp_path / "exported", step=2))
    base = load_state_dict_file(tiny_model_dir)
    assert any(not merged[k].equal(base[k]) for k in base if k.endswith("q_proj.weight"))
    assert all(merged[k].equal(base[k]) for k in base if k.endswith(("k_proj.weight", "up_proj.weight")))
    store = SQLiteStore(run_dir / "store.sqlite")
    versions = {
        ro.metadata["step"]: {c.weight_version for c in store.calls(ro.rollout_id)}
        for ro in store.list_rollouts(limit=1000)[0]
        if "step" in ro.metadata
    }
    assert versions == {0: {0}, 1: {1}}
    engine_log = next((run_dir / "logs").glob("engine*.log")).read_text()
    assert engine_log.count("event=weights_swapped") == engine_log.count("event=lora_adapter_merged") == 2
