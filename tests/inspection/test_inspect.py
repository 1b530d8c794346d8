"""`harnessrl inspect`: the index of rollouts per step and one rollout's calls and rows, read from a real
SQLite store whose calls carry real SmolLM2 token ids (and from a run recorded by the real gateway,
engine and calc harness); `rollouts/index.tsv`; clear errors for a missing run or an unknown rollout."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from harnessrl.config import RunConfig
from harnessrl.inspection import index_report, main, rollout_place, rollout_report, write_rollout_index
from harnessrl.schema import (
    Rollout,
)
from tests.support.gateway import GatewayHandle
from tests.support.run_fixtures import FINAL_TEXT, QUESTION, TOOL_TEXT, Fixture


def test_index_lists_training_rollouts_per_step_with_rows_and_break_causes(fixture_run: Fixture) -> None:
    rep = index_report(fixture_run.run_dir)
    by_id = {r["rollout_id"]: r for r in rep["rollouts"]}
    assert [r["rollout_id"] for r in rep["rollouts"]] == [
        "roaaaa1111",
        "roaaaa2222",
        "robbbb3333",
        "rocccc4444",
    ]
    assert [by_id[r]["step"] for r in by_id] == [1, 1, 1, 2] and rep["total"] == rep["shown"] == 4
    a, b, c, d = (by_id[r] for r in ("roaaaa1111", "roaaaa2222", "robbbb3333", "rocccc4444"))
    assert (a["calls"], a["rows"], a["breaks"]) == (3, 2, {"history_edited": 1})
    assert (b["calls"], b["rows"], b["breaks"]) == (2, 2, {"retokenized": 1})
    # all three calls counted; rows from the last attempt only, as the trainer does
    assert (c["attempts"], c["calls"], c["rows"], c["breaks"]) == (2, 3, 2, {"truncation": 1})
    assert (d["calls"], d["rows"], d["breaks"]) == (2, 1, {})  # the failed call makes no row
    assert [x["reward"] for x in (a, b, c, d)] == [1.0, 0.0, 0.5, 1.0]
    assert {x["task_id"] for x in (a, b, c)} == {"add"} and a["group_id"] == c["group_id"] == "runx-s0-add"
    std = math.sqrt(((1.0 - 0.5) ** 2 + (0.0 - 0.5) ** 2) / 3)  # GRPO over the group {1, 0, 0.5}
    assert a["advantage"] == pytest.approx(0.5 / (std + 1e-6)) and c["advantage"] == pytest.approx(0.0)
    assert d["advantage"] == 0.0  # a group of one
    steps = {s["step"]: s for s in rep["steps"]}
    assert steps[1]["rollouts"] == 3 and steps[1]["reward_mean"] == pytest.approx(0.5)
    assert steps[1]["breaks"] == {"history_edited": 1, "retokenized": 1, "truncation": 1}
    assert steps[1]["calls"] == 8 and steps[2]["rows"] == 1


def test_index_filters_by_step_eval_and_limit(fixture_run: Fixture) -> None:
    only2 = index_report(fixture_run.run_dir, step=2)
    assert [r["rollout_id"] for r in only2["rollouts"]] == ["rocccc4444"]
    ev = index_report(fixture_run.run_dir, evals=True)
    assert [(r["rollout_id"], r["phase"], r["step"], r["eval_label"]) for r in ev["rollouts"]] == [
        ("roeeee5555", "eval", 0, "eval-before-t0")
    ]
    limited = index_report(fixture_run.run_dir, limit=2)
    assert (limited["total"], limited["shown"], len(limited["rollouts"])) == (4, 2, 2)


def test_one_rollout_calls_and_rows_decoded_with_mask_and_logprobs(fixture_run: Fixture) -> None:
    rep = rollout_report(fixture_run.run_dir, "roaaaa1")  # a unique prefix
    calls, rows, tok = rep["calls"], rep["rows"], fixture_run.tok
    stored = fixture_run.calls["roaaaa1111"]
    assert rep["decoded"] and rep["rollout"]["rollout_id"] == "roaaaa1111"
    assert rep["rollout"]["reward_details"] == {"why": "graded 1.0"}
    assert [c["completion_text"] for c in calls] == [TOOL_TEXT, FINAL_TEXT, FINAL_TEXT]
    assert calls[0]["tool_calls"] == [{"name": "calc", "arguments": {"expression": "2+3"}}]
    assert [c["prompt_tokens"] for c in calls] == [len(s.prompt_ids) for s in stored]
    assert [(c["row"], c["break_cause"]) for c in calls] == [(0, None), (0, None), (1, "history_edited")]
    assert [r["calls"] for r in rows] == [[0, 1], [2]]
    row = rows[0]
    assert row["tokens"] == stored[1].prompt_ids + stored[1].completion_ids
    trainable = [i for i, m in enumerate(row["loss_mask"]) if m]
    assert (
        len(trainable) == len(stored[0].completion_ids) + len(stored[1].completion_ids) == row["n_trainable"]
    )
    assert [row["logprobs"][i] for i in trainable] == stored[0].completion_logprobs + stored[
        1
    ].completion_logprobs
    assert "".join(row["pieces"]) == tok.decode(row["tokens"], skip_special_tokens=False)
    sampled = "".join(row["pieces"][i] for i in trainable)
    assert sampled == TOOL_TEXT + FINAL_TEXT and QUESTION in "".join(row["pieces"][: trainable[0]])


def test_rollout_of_retried_attempt_and_failed_call(fixture_run: Fixture) -> None:
    c = rollout_report(fixture_run.run_dir, "robbbb")
    assert [a["status"] for a in c["rollout"]["attempt_details"]] == ["infra_error", "exited"]
    assert c["rollout"]["attempt_details"][0]["folder"] == "rollouts/robbbb3333/attempt-0"
    assert [(x["attempt"], x["finish_reason"], x["row"], x["weight_version"]) for x in c["calls"]] == [
        (0, "stop", None, 0), (1, "length", 0, 0), (1, "stop", 1, 1)
    ]  # fmt: skip
    assert c["calls"][2]["break_cause"] == "truncation" and [r["attempt"] for r in c["rows"]] == [1, 1]
    d = rollout_report(fixture_run.run_dir, "runx-s1-mul-0")  # a client id works too
    assert [(x["status"], x["error"], x["row"]) for x in d["calls"]] == [
        ("failed", "upstream 503", None),
        ("ok", None, 0),
    ]


def test_without_a_tokenizer_ids_are_shown_and_answers_kept(fixture_run: Fixture, tmp_path: Path) -> None:
    rep = rollout_report(fixture_run.run_dir, "roaaaa1", tokenizer=tmp_path / "nowhere")
    assert not rep["decoded"] and "no tokenizer.json" in rep["tokenizer"]
    assert rep["calls"][1]["completion_text"] == "The answer is 5."  # the recorded answer
    assert rep["rows"][0]["pieces"][:2] == [f"<{t}>" for t in rep["rows"][0]["tokens"][:2]]


def test_terminal_tables(
    fixture_run: Fixture, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # the index fits a narrow terminal: ids and causes whole
    assert main([str(fixture_run.run_dir)]) == 0
    out = capsys.readouterr().out
    for text in (
        "roaaaa1111",
        "robbbb3333",
        "rocccc4444",
        "history_edited",
        "retokenized",
        "truncation",
        "0.500",
    ):
        assert text in out
    assert "roeeee5555" not in out  # evaluation rollouts only with --eval
    monkeypatch.setenv("COLUMNS", "240")
    assert main([str(fixture_run.run_dir), "--rollout", "roaaaa1", "--tokens"]) == 0
    out = capsys.readouterr().out
    assert "The answer is 5." in out and "⟦" in out and "⟧" in out and "history_edited" in out
    assert 'calc({"expression": "2+3"})' in out and "trainable (1)" in out and "prompt (0)" in out
    lp = fixture_run.calls["roaaaa1111"][0].completion_logprobs[0]
    assert f"{lp:.4f}" in out  # the per-token table


def test_errors_exit_2_with_a_message(
    fixture_run: Fixture, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "store.sqlite").write_text("not a database, " * 100)
    cases = [
        ([str(tmp_path / "missing")], "no run directory at"),
        ([str(tmp_path)], "holds no store.sqlite"),
        ([str(garbage)], "is not a readable harnessrl store"),
        ([str(fixture_run.run_dir), "--rollout", "zzz"], "no rollout matches 'zzz'"),
        ([str(fixture_run.run_dir), "--rollout", "roaaaa"], "'roaaaa' matches 2 rollouts"),
        ([str(fixture_run.run_dir), "--step", "7"], "steps with training rollouts: 1-2"),
        ([str(fixture_run.run_dir), "--limit", "-1"], "--limit must be"),
        ([str(fixture_run.run_dir), "--bogus"], "unrecognized arguments"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "store.sqlite").exists()  # inspecting a non-run created nothing there


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_module_entry_point_and_no_torch(fixture_run: Fixture) -> None:
    run = str(fixture_run.run_dir)
    done = _python("-m", "harnessrl.inspection", run, "--rollout", "roaaaa2", "--json")
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert rep["calls"][1]["break_cause"] == "retokenized" and rep["calls"][0]["completion_text"].startswith(
        "Hello"
    )
    bad = _python("-m", "harnessrl.inspection", run, "--rollout", "nope")
    assert bad.returncode == 2 and "no rollout matches 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    code = f"import sys, harnessrl.inspection as i; rc = i.main([{run!r}]); assert 'torch' not in sys.modules; print(rc)"
    light = _python("-c", code)
    assert light.returncode == 0 and light.stdout.strip().endswith("0"), light.stderr


def test_rollout_index_file(fixture_run: Fixture) -> None:
    path = write_rollout_index(fixture_run.run_dir)
    assert path == fixture_run.run_dir / "rollouts" / "index.tsv"
    header, *lines = path.read_text().splitlines()
    cols = header.split("\t")
    rows = {r["folder"]: r for r in (dict(zip(cols, line.split("\t"), strict=True)) for line in lines)}
    assert set(rows) == set(fixture_run.calls)
    a, c, e = rows["roaaaa1111"], rows["robbbb3333"], rows["roeeee5555"]
    assert (a["phase"], a["step"], a["task_id"], a["group_id"], a["reward"], a["calls"]) == (
        "train", "1", "add", "runx-s0-add", "1", "3"
    )  # fmt: skip
    assert (c["attempts"], c["reward"], c["state"]) == ("2", "0.5", "succeeded")
    assert (e["phase"], e["step"], e["eval_label"], e["group_id"]) == ("eval", "0", "eval-before-t0", "")
    assert main([str(fixture_run.run_dir), "--write-index"]) == 0 and path.is_file()


def test_place_from_metadata_and_client_id() -> None:
    def ro(client_id: str, **meta: Any) -> Rollout:
        return Rollout(
            rollout_id="r", client_id=client_id, task_id="t", metadata=meta, created_at=0, updated_at=0
        )

    assert rollout_place(ro("x", step=3)) == rollout_place(ro("runab-s3-t7-0"))
    assert rollout_place(ro("x", step=3)).step == 4  # the update it fed, numbered as in metrics.jsonl
    assert (rollout_place(ro("x", group=5)).group, rollout_place(ro("x", group=5)).step) == (5, None)
    assert rollout_place(ro("runab-g12-t7-1")).group == 12
    assert rollout_place(ro("x", eval="eval-step4-t0")).step == 4
    assert rollout_place(ro("x", eval="eval-after-20-t1")).step == 20
    assert rollout_place(ro("x", eval="eval-before-t0")).step == 0
    assert rollout_place(ro("check-1")).phase == "other"


async def test_a_run_recorded_by_gateway_engine_and_harness(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rollouts of the real calc harness through the real gateway and engine; inspect reads them back."""
    from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
    from harnessrl.examples import get_example
    from harnessrl.gateway.client import ControlClient

    gw = make_gateway(default_max_tokens=12)
    run_dir = tmp_path / "run"
    example = get_example("calc")
    train, _ = example.build_splits(4, 1, 0)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec(command=example.harness_command, timeout_s=120), example.grader,
                     run_dir, concurrency=3)  # fmt: skip
    requests = [
        RolloutRequest(task=train[0], client_id=f"runx-s0-{train[0].task_id}-{k}",
                       group_id=f"runx-s0-{train[0].task_id}", metadata={"step": 0})
        for k in range(2)
    ]  # fmt: skip
    try:
        outcomes = await ctl.run(requests)
    finally:
        await client.aclose()
    with sqlite3.connect(gw.store.path) as src, sqlite3.connect(run_dir / "store.sqlite") as dst:
        src.backup(dst)  # the run directory's store.sqlite, as a run leaves it
    cfg = RunConfig.model_validate({"run_dir": str(run_dir), "engine": {"model": str(tiny_model_dir)}})
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    rep = index_report(run_dir)
    by_id = {r["rollout_id"]: r for r in rep["rollouts"]}
    assert sorted(by_id) == sorted(o.rollout_id for o in outcomes)
    for o in outcomes:
        r = by_id[o.rollout_id]
        assert (r["step"], r["task_id"], r["state"]) == (1, train[0].task_id, "succeeded")
        assert r["reward"] == o.reward is not None and r["group_id"] == f"runx-s0-{train[0].task_id}"
        assert r["calls"] == len(gw.store.calls(o.rollout_id)) >= 1 and r["rows"] >= 1
    one = rollout_report(run_dir, outcomes[0].rollout_id[:10])
    tok = Tokenizer.from_file(str(Path(one["tokenizer"])))
    for c, stored in zip(one["calls"], gw.store.calls(outcomes[0].rollout_id), strict=True):
        assert c["completion_text"] == tok.decode(stored.completion_ids, skip_special_tokens=False)
        content = (stored.response or {})["choices"][0]["message"].get("content") or ""
        # What the harness got is what the model sampled. The response's text leaves out special tokens (as
        # OpenAI's and vLLM's do), and the random tiny model can sample one mid-completion.
        assert content.strip() in tok.decode(stored.completion_ids, skip_special_tokens=True)
    assert sum(r["n_trainable"] for r in one["rows"]) == sum(c["completion_tokens"] for c in one["calls"])
    folder = run_dir / one["rollout"]["attempt_details"][0]["folder"]
    assert (folder / "stdout.txt").exists() and (folder / "stderr.txt").exists()
