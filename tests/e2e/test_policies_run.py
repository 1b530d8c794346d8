"""A whole run with several policies: the `plan_solve` example (a planner call and a solver call per
attempt, the real harness in a subprocess) with `policies:` + `train.lora` on a tiny random model.
The engine process serves both adapters, the gateway picks each call's policy by its model name, one
step trains both adapters, the checkpoint holds each policy's adapter and training state, and a
resumed run starts from that checkpoint, serves its adapters and trains them on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from harnessrl.config import load_config
from harnessrl.examples import get_example
from harnessrl.modeling.loading import load_state_dict_file
from harnessrl.modeling.lora import ADAPTER_WEIGHTS
from harnessrl.runs.flow import run
from harnessrl.store import SQLiteStore
from harnessrl.trainer.export_model import ExportModelError, export_model

# A tiny random model never answers right: this grader spreads rewards over a group by the attempt's
# output folder (unique per rollout), so that every group has a signal to train on.
GRADER = """
import zlib

def grade(task, result):
    return (zlib.crc32(str(result.output_dir).encode()) % 1000) / 1000
"""
POLICIES = ("planner", "solver")


def _overrides(tmp_path: Path, model_dir: Path, steps: int) -> list[str]:
    return [
        "grader.python=policies_grader:grade", f"run_dir={tmp_path / 'run'}", f"engine.model={model_dir}",
        "engine.max_batch=4", "engine.max_model_len=2048", "engine.threads=1", f"train.steps={steps}",
        "train.batch_groups=1", "train.group_size=3", "train.checkpoint_every=1", "train.lr=5e-2",
        "train.lora.r=4", "train.lora.target_modules=[q_proj, v_proj]", "controller.concurrency=3",
        "eval.n_heldout=1", "data.n_train=10", "gateway.default_max_tokens=8",
    ]  # fmt: skip


def _adapter(run_dir: Path, step: int, policy: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "policies" / policy / ADAPTER_WEIGHTS))


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not a[k].equal(b[k]) for k in a)


def _train_calls(store: SQLiteStore) -> dict[int, list[tuple[str | None, int | None]]]:
    """(policy, weight_version) of every call of the training rollouts, by step."""
    out: dict[int, list[tuple[str | None, int | None]]] = {}
    for ro in store.list_rollouts(limit=1000)[0]:
        if "step" in ro.metadata:
            calls = store.calls(ro.rollout_id)
            out.setdefault(ro.metadata["step"], []).extend((c.policy, c.weight_version) for c in calls)
    return out


@dataclass
class FirstRun:
    """The run directory after one step, with what it held then (the resume test changes it)."""

    run_dir: Path
    config: Path
    records: list[dict[str, Any]]
    adapters: dict[str, dict[str, torch.Tensor]]
    calls: dict[int, list[tuple[str | None, int | None]]]


@pytest.fixture(scope="module")
def first_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstRun]:
    """One step of `plan_solve` with its two policies, checkpointed (the module's two tests share it)."""
    tmp_path = tmp_path_factory.mktemp("policies-run")
    (tmp_path / "policies_grader.py").write_text(GRADER)
    config = get_example("plan_solve").config_path
    assert config is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))
        summary = run(load_config(config, _overrides(tmp_path, tiny_model_dir, 1)), fresh=True)
        assert summary["train_steps"] == 1
        run_dir = tmp_path / "run"
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        adapters = {p: _adapter(run_dir, 1, p) for p in POLICIES}
        yield FirstRun(
            run_dir, config, records, adapters, _train_calls(SQLiteStore(run_dir / "store.sqlite"))
        )


def test_one_step_trains_each_policy_into_its_adapter(first_run: FirstRun) -> None:
    (record,) = first_run.records
    per = record["policies"]
    assert sorted(per) == list(POLICIES) and record["rows_of_no_policy"] == 0
    assert all(per[p]["rows"] == 3 and per[p]["grad_norm"] > 0 for p in POLICIES)  # a row per call
    for p in POLICIES:  # each adapter's B moved from 0, and the two adapters differ
        assert any(float(t.abs().max()) > 0 for k, t in first_run.adapters[p].items() if "lora_B" in k)
    assert _moved(first_run.adapters["planner"], first_run.adapters["solver"])
    # every training call: a planner and a solver call per rollout, served by its adapter's version 0
    assert sorted(first_run.calls) == [0]
    assert sorted(first_run.calls[0]) == [("planner", 0)] * 3 + [("solver", 0)] * 3
    for p in POLICIES:  # the engine was sent each policy's adapter by name, unchanged before, trained after
        assert (first_run.run_dir / "weights" / "policies" / p / "v1" / ADAPTER_WEIGHTS).is_file()


def test_export_model_merges_the_policy_asked_for(
    first_run: FirstRun, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ExportModelError, match=r"pass --policy NAME \(its policies: planner, solver\)"):
        export_model(first_run.run_dir, tmp_path / "none")
    with pytest.raises(ExportModelError, match="no policy 'coder'"):
        export_model(first_run.run_dir, tmp_path / "none", policy="coder")
    base = load_state_dict_file(tiny_model_dir)
    merged = {
        p: load_state_dict_file(export_model(first_run.run_dir, tmp_path / p, policy=p)) for p in POLICIES
    }
    for p in POLICIES:  # the adapted projections moved, the others are the base's
        assert any(not merged[p][k].equal(base[k]) for k in base if k.endswith("q_proj.weight"))
        assert all(merged[p][k].equal(base[k]) for k in base if k.endswith("k_proj.weight"))
        assert (tmp_path / p / "tokenizer.json").is_file()
    assert any(not merged["planner"][k].equal(merged["solver"][k]) for k in base)


@pytest.mark.slow  # heavy for the suite's 15 minutes: `pytest -m slow` runs it
def test_a_resumed_run_trains_on_from_the_policies_checkpoint(
    first_run: FirstRun, tiny_model_dir: Path
) -> None:
    run_dir = first_run.run_dir
    cfg = load_config(first_run.config, _overrides(run_dir.parent, tiny_model_dir, 2))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(run_dir.parent))
        summary = run(cfg, resume=True, check=False)
    assert summary["train_steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in records] == [1, 2]
    assert all(r["policies"][p]["grad_norm"] > 0 for r in records for p in POLICIES)
    for p in POLICIES:  # the resumed run trained on from the checkpoint's adapters and optimizer state
        assert _moved(first_run.adapters[p], _adapter(run_dir, 2, p))
        state = torch.load(run_dir / "checkpoints" / "step-2" / "policies" / p / "training.pt")
        assert all(int(s["step"]) == 2 for s in state["optimizer"]["state"].values())
    # the second step's calls were served by the checkpoint's adapters (version 1), one of each policy
    calls = _train_calls(SQLiteStore(run_dir / "store.sqlite"))
    assert sorted(calls[1]) == [("planner", 1)] * 3 + [("solver", 1)] * 3
    engine_log = next((run_dir / "logs").glob("engine*.log")).read_text()
    for p in POLICIES:  # published after the update, then again by the resumed run from its checkpoint
        assert engine_log.count(f"event=adapter_served name={p} version=1 ") == 2
