"""Several policies in what reads a run: `harnessrl inspect` shows each call's and row's policy, and
the exported training rows carry it (a real SQLite store in a run folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.export.rows import iter_rows
from harnessrl.inspection import main, rollout_report
from harnessrl.inspection.runview import RunSettings
from harnessrl.schema import Call, CallStatus, RewardIn, RolloutCreate, RolloutState
from harnessrl.store import SQLiteStore


def _call(n: int, prompt: list[int], policy: str) -> Call:
    return Call(call_id=f"c{n}", rollout_id="ro", attempt=0, created_at=1.0, latency_s=0.1,
                status=CallStatus.OK, model=policy, upstream="engine0", request={}, prompt_ids=prompt,
                completion_ids=[40 + n], completion_logprobs=[-0.5], weight_version=2, policy=policy)  # fmt: skip


def _run_dir(tmp_path: Path) -> Path:
    store = SQLiteStore(tmp_path / "store.sqlite")
    for rid, reward in (("ro", 1.0), ("ro2", 0.0)):
        store.create_rollout(
            RolloutCreate(client_id=rid, task_id="t", group_id="g", metadata={"step": 0}), rid
        )
        store.start_attempt(rid)
        if rid == "ro":
            store.add_calls([_call(0, [1, 2], "planner"), _call(1, [1, 2, 40, 3], "solver")])
        store.set_state(rid, RolloutState.SUCCEEDED)
        store.set_reward(rid, RewardIn(value=reward))
    store.close()
    return tmp_path


def test_inspect_and_export_show_the_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _run_dir(tmp_path)
    report = rollout_report(run_dir, "ro")
    assert [c["policy"] for c in report["calls"]] == ["planner", "solver"]
    assert [r["policy"] for r in report["rows"]] == ["planner", "solver"]
    monkeypatch.setenv("COLUMNS", "200")
    assert main([str(run_dir), "--rollout", "ro"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "planner" in out and "solver" in out
    store = SQLiteStore(run_dir / "store.sqlite")
    rows = list(iter_rows(store, RunSettings(), "run"))
    store.close()
    assert sorted((r.rollout_id, r.policy) for r in rows) == [("ro", "planner"), ("ro", "solver")]
