"""The whole calc loop on transformers-path models (slow: engine and gateway processes, the real calc
harness): `harnessrl check` for each tiny generic family, then for tiny Qwen3.5 a training step, its
checkpoint exported with `export-model`, loaded by transformers, and `harnessrl eval` on the export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.runs.evaluate import evaluate_model
from harnessrl.runs.flow import run
from harnessrl.runs.preflight import run_check
from harnessrl.trainer.export_model import export_model
from tests.support.generic_families import GENERIC, generic_dir

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
SMALL = [
    "engine.max_batch=4", "engine.max_model_len=1024", "engine.threads=1", "controller.concurrency=4",
    "gateway.default_max_tokens=12", "eval.n_heldout=2", "eval.extra_temperatures=[]", "data.n_train=8",
]  # fmt: skip


@pytest.mark.parametrize("name", list(GENERIC))
def test_check_passes_on_the_calc_example(name: str, tmp_path: Path) -> None:
    cfg = load_config(get_example("calc").config_path, [*SMALL, f"engine.model={generic_dir(name)}"])
    report = run_check(cfg)
    assert report.ok, report.render()
    assert report.model_path.startswith("transformers (") and report.calls_with_token_ids >= 1


def test_qwen35_trains_exports_and_evaluates(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    overrides = [*SMALL, f"run_dir={tmp_path / 'run'}", f"engine.model={generic_dir('qwen3_5')}",
                 "train.steps=1", "train.batch_groups=1", "train.group_size=2", "train.checkpoint_every=1",
                 "train.lr=1e-3"]  # fmt: skip
    summary = run(load_config(get_example("calc").config_path, overrides), fresh=True)
    assert summary["train_steps"] == 1
    out = export_model(tmp_path / "run", tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    result = evaluate_model(load_config(get_example("calc").config_path, SMALL), str(out))
    assert result["n_heldout"] == 2 and result["heldout_by_temperature"]["0"]["n"] == 2
