"""The `opencode_calc` example: SmolLM2 trained behind the real OpenCode CLI.

Fast: the config loads and names importable pieces; the wrapper writes OpenCode's config for the
gateway from the harness contract (checked against a fake environment), runs the binary it finds (a
stand-in script here, a real subprocess) with the task on stdin, keeps its stdout and the answer file
for the grader and passes its exit code on; the grader reads the answer file, else the last number. Slow (`-m slow`, needs
`bash bench/harnesses/setup.sh opencode`): the real OpenCode on the real SmolLM2 through the engine
and gateway, one training step with a held-out evaluation before and after.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.opencode_calc import harness as oc
from harnessrl.examples.opencode_calc.task import build_splits, grade, last_number
from harnessrl.schema import Task

EXAMPLE = Path(oc.__file__).parent
CONFIG = EXAMPLE / "config.yaml"
REPO = EXAMPLE.parents[3]


def _contract_env(tmp_path: Path, question: str = "What is 6 * 7?") -> dict[str, str]:
    """The variables the controller gives an attempt (docs/your-harness.md), with fake values."""
    out = tmp_path / "output"
    out.mkdir(exist_ok=True)
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"question": question}))
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "OPENAI_API_KEY": "hrl-rollout-key-123",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        "ANTHROPIC_API_KEY": "hrl-rollout-key-123",
        "HARNESSRL_TASK": str(task),
        "HARNESSRL_OUTPUT": str(out),
        "HARNESSRL_ROLLOUT_ID": "ro-test-1",
    }


def test_config_loads_with_the_wrapper_tasks_and_grader() -> None:
    cfg = load_config(CONFIG)
    assert cfg.missing() == []
    assert cfg.harness.command == [sys.executable, str(EXAMPLE / "harness.py")]
    assert cfg.engine.model == "smollm2" and cfg.gateway.mode == "tito" and cfg.controller.sandbox is False
    assert cfg.train.steps <= 3 and cfg.eval.n_heldout <= 16
    train, heldout = build_splits(8, 4, seed=0)
    assert len(train) == 8 and len(heldout) == 4
    assert {t.input["question"] for t in train}.isdisjoint(t.input["question"] for t in heldout)


def test_wrapper_writes_opencode_config_for_the_gateway(tmp_path: Path) -> None:
    env = _contract_env(tmp_path)
    path, oc_env = oc.prepare(tmp_path, env)
    text = path.read_text()
    assert path == tmp_path / "opencode.json"
    assert env["OPENAI_API_KEY"] not in text  # OpenCode reads the key from the environment
    cfg = json.loads(text)
    provider = cfg["provider"]["harnessrl"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:9/v1", "apiKey": "{env:OPENAI_API_KEY}",
                                   "headerTimeout": False, "chunkTimeout": False}  # fmt: skip
    assert provider["models"][oc.MODEL]["limit"]["output"] == oc.MAX_OUTPUT_TOKENS
    assert cfg["model"] == cfg["small_model"] == f"harnessrl/{oc.MODEL}"
    agent = cfg["agent"][oc.AGENT]
    assert agent["mode"] == "primary" and agent["prompt"] == oc.PROMPT and agent["steps"] == oc.MAX_STEPS
    assert agent["tools"] == {"*": False, "write": True}  # one tool: a short prompt
    assert oc_env["OPENCODE_CONFIG"] == str(path) and oc_env["OPENAI_API_KEY"] == env["OPENAI_API_KEY"]
    assert oc_env["OPENCODE_DISABLE_PROJECT_CONFIG"] == "1" and oc_env["npm_config_offline"] == "true"
    argv = oc.command("opencode", env["HARNESSRL_ROLLOUT_ID"])
    assert argv == ["opencode", "run", "--pure", "--agent", "calc", "--title", "ro-test-1"]


@pytest.mark.parametrize(
    "missing", ["OPENAI_BASE_URL", "OPENAI_API_KEY", "HARNESSRL_TASK", "HARNESSRL_OUTPUT"]
)
def test_wrapper_without_the_contract_exits_2_naming_the_variable(tmp_path: Path, missing: str) -> None:
    env = _contract_env(tmp_path)
    del env[missing]
    proc = subprocess.run([sys.executable, str(EXAMPLE / "harness.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 2 and missing in proc.stderr
    assert not (tmp_path / "opencode.json").exists()


def test_wrapper_without_a_binary_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oc, "REPO_BIN", tmp_path / "absent")
    assert oc.find_opencode({"PATH": str(tmp_path)}) is None
    assert oc.find_opencode({"PATH": str(tmp_path), "OPENCODE_BIN": "/x/opencode"}) == "/x/opencode"


FAKE_OPENCODE = """import json, os, sys
cfg = json.load(open(os.environ["OPENCODE_CONFIG"]))
record = {{"argv": sys.argv[1:], "stdin": sys.stdin.read(), "cwd": os.getcwd(),
          "base_url": cfg["provider"]["harnessrl"]["options"]["baseURL"],
          "key_from_env": os.environ["OPENAI_API_KEY"]}}
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "fake.json"), "w").write(json.dumps(record))
if sys.argv[-1] == "ro-writes":  # the agent wrote the answer file with its tool (a wrong one here)
    open("answer.txt", "w").write("41\\n")
print("6 * 7 is 42.")
print("The answer is 42.")
sys.exit(3)
"""


def test_wrapper_runs_the_binary_and_keeps_its_stdout_for_the_grader(tmp_path: Path) -> None:
    work = tmp_path / "attempt"
    work.mkdir()
    fake = tmp_path / "opencode"
    # a sh wrapper, not a `#!python` line: a shebang cannot hold a path with a space (a clone in
    # "/tmp/ci run/" made the kernel look for "/tmp/ci" and the run fail with ENOENT)
    (tmp_path / "fake_opencode.py").write_text(FAKE_OPENCODE.format())
    fake.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "fake_opencode.py"))} "$@"\n'
    )
    fake.chmod(0o755)
    env = _contract_env(work) | {"OPENCODE_BIN": str(fake)}
    proc = subprocess.run([sys.executable, str(EXAMPLE / "harness.py")], cwd=work, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 3, proc.stderr  # OpenCode's exit code is the harness's
    assert proc.stdout.endswith("The answer is 42.\n")
    record = json.loads((work / "output" / "fake.json").read_text())
    assert record["argv"] == ["run", "--pure", "--agent", "calc", "--title", "ro-test-1"]
    assert record["stdin"] == "What is 6 * 7?" and record["cwd"] == str(work)
    assert record["base_url"] == env["OPENAI_BASE_URL"] and record["key_from_env"] == env["OPENAI_API_KEY"]
    result = AttemptResult(
        exit_code=3, timed_out=False, output_dir=work / "output", stdout_tail="", stderr_tail=""
    )
    right = grade(Task(task_id="t", input={"question": "q"}, reference={"answer": "42"}), result)
    wrong = grade(Task(task_id="t", input={"question": "q"}, reference={"answer": "41"}), result)
    assert right.value == 1.0 and right.details["answer"] == "42" and right.details["source"] == "stdout"
    assert wrong.value == 0.0
    # the answer file, when the agent wrote one, is the answer (its stdout is then not looked at)
    env["HARNESSRL_ROLLOUT_ID"] = "ro-writes"
    proc = subprocess.run([sys.executable, str(EXAMPLE / "harness.py")], cwd=work, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 3 and (work / "output" / "answer.txt").read_text() == "41\n"
    right = grade(Task(task_id="t", input={"question": "q"}, reference={"answer": "41"}), result)
    assert right.value == 1.0 and right.details["source"] == "answer.txt"
    assert grade(Task(task_id="t", input={"question": "q"}, reference={"answer": "42"}), result).value == 0.0


def test_grader_without_output_is_zero(tmp_path: Path) -> None:
    result = AttemptResult(exit_code=2, timed_out=False, output_dir=tmp_path, stdout_tail="", stderr_tail="")
    reward = grade(Task(task_id="t", input={}, reference={"answer": "3"}), result)
    assert reward.value == 0.0 and "did not run" in reward.details["reason"]
    assert last_number("The answer is -3.5.") == "-3.5" and last_number("no idea") is None


def test_pinned_version_matches_the_harness_suite() -> None:
    setup = (REPO / "bench" / "harnesses" / "setup.sh").read_text()
    drivers = (REPO / "bench" / "harnesses" / "drivers.py").read_text()
    assert re.search(r"^OPENCODE=(\S+)$", setup, re.M).group(1) == oc.OPENCODE_VERSION  # type: ignore[union-attr]
    assert f'"opencode": "{oc.OPENCODE_VERSION}"' in drivers


@pytest.mark.slow
def test_opencode_trains_smollm2_end_to_end(tmp_path: Path) -> None:
    """The real OpenCode on the real SmolLM2: the preflight attempt, held-out before and after, one step.
    Minutes on 2 cores (each call prefills a ~1.6k-token prompt)."""
    if oc.find_opencode({"PATH": ""}) is None:
        pytest.skip("OpenCode not installed: bash bench/harnesses/setup.sh opencode")
    import harnessrl

    summary = harnessrl.train(
        CONFIG, run_dir=str(tmp_path / "run"),
        **{"train.steps": 1, "train.batch_groups": 1, "train.group_size": 2, "eval.n_heldout": 2},
    )  # fmt: skip
    assert summary["train_steps"] == 1 and summary["rollouts_failed_total"] == 0
    assert summary["heldout_reward_before"] is not None and summary["heldout_reward_after"] is not None
    assert summary["heldout_failed_before"] == summary["heldout_failed_after"] == 0
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["rollouts"] == 2 and step["calls"] >= 2  # every rollout made at least one recorded call
