"""`harnessrl eval --config C --model DIR`: the config's held-out tasks through its real harness on a model
folder, no training, reported per eval temperature (and as JSON with --out); a model that is not there is
one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.cli import main as harnessrl
from harnessrl.examples import get_example


def test_eval_runs_the_heldout_tasks_on_a_model_folder(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval.json"
    config = str(get_example("calc").config_path)
    overrides = ["eval.n_heldout=3", "eval.temperature=0.0", "eval.extra_temperatures=[1.0]", "engine.threads=1",
                 "engine.max_model_len=2048", "gateway.default_max_tokens=16", f"run_dir={tmp_path / 'unused'}"]  # fmt: skip
    rc = harnessrl(
        ["eval", "--config", config, "--model", str(tiny_model_dir), "--out", str(out), *overrides]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out reward at T=0:" in printed and "held-out reward at T=1:" in printed
    result = json.loads(out.read_text())
    assert result["model"] == str(tiny_model_dir) and result["n_heldout"] == 3
    for by_temp in result["heldout_by_temperature"].values():
        assert by_temp["n"] + by_temp["failed"] == 3 and 0.0 <= by_temp["mean"] <= 1.0
    rollouts = Path(result["work_dir"]) / "rollouts"
    assert len(list(rollouts.iterdir())) == 6  # 3 tasks at each of 2 temperatures, run by the harness
    assert not (tmp_path / "unused").exists()  # no run directory: nothing is trained


def test_eval_of_a_missing_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(get_example("calc").config_path)
    assert harnessrl(["eval", "--config", config, "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "engine.model" in err and "nope" in err and "Traceback" not in err
