"""`harnessrl inspect` shows a rollout's judge call (prompt, answer, parsed verdict), its step rewards
and its annotations, read from a real SQLite store in a run folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.inspection import main, rollout_report
from harnessrl.schema import AnnotationIn, RewardIn, RolloutCreate, RolloutState, StepReward
from harnessrl.store import SQLiteStore

JUDGE = {
    "mode": "group", "model": "judge-m", "answer": "B is the most piratey.\nRANKING: 2 > 1",
    "prompt": [{"role": "system", "content": "Rubric: sounds like a pirate"},
               {"role": "user", "content": "[1]\nhello\n\n[2]\nahoy matey"}],
    "ranking": [2, 1], "candidate": 2, "place": 1,
}  # fmt: skip


def _run_dir(tmp_path: Path, allow: bool) -> Path:
    store = SQLiteStore(tmp_path / "store.sqlite")
    meta = {"allow_annotation_rewards": True} if allow else {}
    store.create_rollout(RolloutCreate(client_id="c1", task_id="style", metadata=meta), "ro-judged")
    store.start_attempt("ro-judged")
    store.set_state("ro-judged", RolloutState.SUCCEEDED)
    store.set_reward("ro-judged", RewardIn(value=1.0, details={"judge": JUDGE, "exit_code": 0},
                                           steps=[StepReward(call=0, value=0.25)]))  # fmt: skip
    store.add_annotation("ro-judged", AnnotationIn(tool_call_id="tc-7", value=0.5, label="used the tool"))
    store.close()
    return tmp_path


@pytest.mark.parametrize("allow", [False, True])
def test_judge_call_step_rewards_and_annotations_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, allow: bool
) -> None:
    run_dir = _run_dir(tmp_path, allow)
    credit = rollout_report(run_dir, "ro-judged")["credit"]
    assert credit["judge"] == JUDGE and credit["step_rewards"][0]["value"] == 0.25
    assert credit["annotations"][0]["label"] == "used the tool"
    monkeypatch.setenv("COLUMNS", "200")
    assert main([str(run_dir), "--rollout", "ro-judged"]) == 0
    out = capsys.readouterr().out
    assert "judge (group, model judge-m): ranking [2, 1], this rollout is candidate 2 at place 1" in out
    assert "Rubric: sounds like a pirate" in out and "RANKING: 2 > 1" in out and "ahoy matey" in out
    assert "call 0" in out and "+0.250" in out and "tool call tc-7" in out and "used the tool" in out
    assert ("+0.500 (data)" in out) is not allow


def test_a_logprob_judge_shows_its_expected_digit_and_the_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    judge = {"mode": "logprob", "model": "judge-m", "answer": "7", "prompt": [{"role": "user", "content": "rate"}],
             "score": 6.25, "digit_mass": 0.8, "digits": {"3": 0.2, "7": 0.5, "9": 0.1}}  # fmt: skip
    store = SQLiteStore(tmp_path / "store.sqlite")
    store.create_rollout(RolloutCreate(client_id="c1", task_id="style"), "ro-lp")
    store.start_attempt("ro-lp")
    store.set_state("ro-lp", RolloutState.SUCCEEDED)
    store.set_reward("ro-lp", RewardIn(value=6.25 / 9, details={"judge": judge}))
    store.close()
    monkeypatch.setenv("COLUMNS", "200")
    assert main([str(tmp_path), "--rollout", "ro-lp"]) == 0
    out = capsys.readouterr().out
    assert "judge (logprob, model judge-m): score 6.25" in out
    assert "digits: 3: 0.200, 7: 0.500, 9: 0.100 (their mass among the top 20 first tokens: 0.8)" in out
