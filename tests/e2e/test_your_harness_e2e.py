"""A scaffolded project trained end to end: through the `harnessrl` command (init, check, train,
inspect as subprocesses) and through the Python API, with a Ctrl-C in the middle of a step and a
resume that redoes that step's cancelled rollouts. Real engine (tiny model, real tokenizer), gateway,
and the scaffold's own openai-SDK harness as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import harnessrl
from harnessrl.runs.flow import run

SMALL = [
    "engine.max_batch=8",
    "engine.threads=1",
    "gateway.default_max_tokens=16",
    "controller.concurrency=1",
    "controller.fork_server=false",
    "train.batch_groups=2",
    "train.group_size=2",
    "train.checkpoint_every=1",
    "eval.n_heldout=2",
]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "harnessrl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


def test_init_check_train_inspect_through_the_cli(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert _cli("init", "agent", cwd=tmp_path).returncode == 0
    cfg = str(tmp_path / "agent" / "config.yaml")
    model = f"engine.model={tiny_model_dir}"
    checked = _cli("check", "--config", cfg, model, *SMALL, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert (
        "model calls  1 recorded, 1 with token IDs" in checked.stdout and "result       OK" in checked.stdout
    )
    trained = _cli("train", "--config", cfg, model, *SMALL, "train.steps=1", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "step   1/1" in trained.stderr and "held-out reward on 2 tasks" in trained.stdout
    run_dir = tmp_path / "runs" / "my_agent"  # run_dir is relative to where harnessrl runs
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=_no_nan)
    assert summary["train_steps"] == 1 and summary["name"] == "agent" and summary["grader_errors_total"] == 0
    again = _cli("train", "--config", cfg, model, *SMALL, "train.steps=1", cwd=tmp_path)
    assert again.returncode == 2 and "--resume" in again.stderr
    shown = _cli("inspect", str(run_dir), "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)


def _no_nan(name: str) -> float:
    raise AssertionError(f"summary.json holds {name}: not strict JSON")


@pytest.mark.slow  # heavy for the suite's 15 minutes: `pytest -m slow` runs it
def test_python_api_ctrl_c_mid_step_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    from harnessrl.runs.scaffold import init_project

    init_project(tmp_path / "agent")
    run_dir = tmp_path / "run"
    overrides = {"engine.model": str(tiny_model_dir), "run_dir": str(run_dir), "train.steps": 2}
    overrides.update({k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in SMALL)})
    cfg = harnessrl.configure(tmp_path / "agent" / "config.yaml", **overrides)

    def progress(label: str, done: int, total: int) -> None:
        if label == "step 2 rollouts" and done == 2:  # half of step 2 done: Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=progress)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]

    summary = harnessrl.train(tmp_path / "agent" / "config.yaml", resume=True, **overrides)
    assert summary["train_steps"] == 2
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["rollouts"] == 4 and records[1]["rollouts_failed"] == 0  # the step's batch is whole
