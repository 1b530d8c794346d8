"""Exported training rows carry per-token advantages when the run trained with `train.credit: step`
(read from its config.json), and none otherwise; read from a real SQLite store of a run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.export.rows import iter_rows
from harnessrl.inspection.runview import read_settings
from harnessrl.schema import Call, CallStatus, RewardIn, RolloutCreate, RolloutState, StepReward
from harnessrl.store import SQLiteStore


def _run(tmp_path: Path, credit: str | None) -> SQLiteStore:
    (tmp_path / "config.json").write_text(json.dumps({"train": {"credit": credit}} if credit else {}))
    store = SQLiteStore(tmp_path / "store.sqlite")
    for rid, reward, step in (("ra", 1.0, 1.0), ("rb", 0.0, 0.0)):
        store.create_rollout(
            RolloutCreate(client_id=rid, task_id="t", group_id="g", metadata={"step": 0}), rid
        )
        store.start_attempt(rid)
        store.add_call(Call(call_id=f"{rid}-0", rollout_id=rid, attempt=0, created_at=0.0, latency_s=0.0,
                            status=CallStatus.OK, model="m", upstream="u", request={}, prompt_ids=[1, 2],
                            completion_ids=[3, 4], completion_logprobs=[-0.1, -0.2]))  # fmt: skip
        store.set_state(rid, RolloutState.SUCCEEDED)
        store.set_reward(rid, RewardIn(value=reward, steps=[StepReward(call=0, value=step)]))
    return store


@pytest.mark.parametrize("credit", [None, "step"])
def test_rows_export_token_advantages_under_step_credit(tmp_path: Path, credit: str | None) -> None:
    store = _run(tmp_path, credit)
    rows = {r.rollout_id: r for r in iter_rows(store, read_settings(tmp_path), run_id="x")}
    store.close()
    assert set(rows) == {"ra", "rb"} and rows["ra"].advantage == pytest.approx(1.0, abs=1e-5)
    if credit is None:
        assert rows["ra"].token_advantages is None
        return
    # GRPO A = ±1; step 0: s = (1, 0), b = 0.5, terms ±0.5 on the two sampled tokens
    assert rows["ra"].token_advantages == pytest.approx([1.0, 1.0, 1.5, 1.5], abs=1e-5)
    assert rows["rb"].token_advantages == pytest.approx([-1.0, -1.0, -1.5, -1.5], abs=1e-5)
