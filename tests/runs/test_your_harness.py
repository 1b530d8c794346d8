"""Bringing one's own harness: the config keys, task files, graders, run directories, init and check.

Fast checks of every bad input first (no services); then real subprocess harnesses through a real
gateway and engine (the preflight, a raising grader, a resumed step's cancelled rollouts)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harnessrl.cli import main as cli
from harnessrl.config import ConfigError, load_config
from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.grader import GraderError, as_reward
from harnessrl.gateway.client import ControlClient
from harnessrl.runs.preflight import preflight
from harnessrl.runs.project import read_tasks, resolve_project
from harnessrl.runs.rundir import Mode, RunDirError, config_diff, prepare
from harnessrl.runs.scaffold import ScaffoldError, init_project, make_tasks
from harnessrl.schema import RewardIn, RolloutState, Task
from tests.support.gateway import GatewayHandle

GRADER = """
def grade(task, result):
    return 1.0 if (result.output_dir / "done.txt").exists() else 0.0, {"checked": True}

def broken(task, result):
    raise ZeroDivisionError("grader bug on " + task.task_id)
"""


def _write_tasks(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder the way a user writes one: harness, tasks, grader, config — no harnessrl import."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "agent.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['HARNESSRL_OUTPUT'], 'done.txt').touch()\n"
    )
    (d / "grader.py").write_text(GRADER)
    (d / "prompt.txt").write_text("be brief")
    _write_tasks(
        d / "train.jsonl", [{"task_id": f"t{i}", "input": {"q": i}, "reference": {"a": i}} for i in range(10)]
    )
    _write_tasks(
        d / "heldout.jsonl", [{"task_id": "h0", "input": {"q": 3}}, {"task_id": "h1", "input": {"q": 99}}]
    )
    (d / "config.yaml").write_text(
        "harness:\n  command: [python, agent.py, --fast]\n  env: {MODE: test}\n  files: [prompt.txt]\n"
        "tasks:\n  train: train.jsonl\n  heldout: heldout.jsonl\ngrader:\n  python: grader:grade\n"
    )
    return d


def test_config_keys_resolve_against_the_config_folder(project: Path) -> None:
    cfg = load_config(project / "config.yaml")
    assert cfg.harness.command == [sys.executable, str(project / "agent.py"), "--fast"]
    assert cfg.harness.files == [str(project / "prompt.txt")] and cfg.name == "proj"
    p = resolve_project(cfg)
    train, heldout = p.splits(cfg)
    assert [t.task_id for t in train] == [f"t{i}" for i in range(10)]
    assert [t.task_id for t in heldout] == ["h1"]  # h0's input is also a training task: dropped
    assert p.grader(train[0], _Result(project)) == (0.0, {"checked": True})
    assert p.harness_spec(5).env == {"MODE": "test"}


class _Result:
    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir


def test_heldout_fraction_is_a_seeded_disjoint_split(tmp_path: Path) -> None:
    _write_tasks(tmp_path / "t.jsonl", make_tasks(80, seed=1))  # type: ignore[arg-type]
    (tmp_path / "c.yaml").write_text(
        "harness: {command: [python, -c, pass]}\ntasks: {train: t.jsonl, heldout_fraction: 0.2}\n"
        "grader: {command: [python, -c, 'print(1)']}\n"
    )

    def split(seed: int) -> tuple[list[Task], list[Task]]:
        cfg = load_config(tmp_path / "c.yaml", [f"data.seed={seed}"])
        return resolve_project(cfg).splits(cfg)

    train, held = split(0)
    assert (len(train), len(held)) == (64, 16)
    assert not {json.dumps(t.input) for t in train} & {json.dumps(t.input) for t in held}
    assert [t.task_id for t in split(0)[1]] == [t.task_id for t in held]
    assert [t.task_id for t in split(1)[1]] != [t.task_id for t in held]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"task_id": "a", "input": {}}\n{"task_id": "a", "input": {}}\n',
            "t.jsonl:2: task_id 'a' appears twice",
        ),
        ('{"task_id": "a", "input": {}}\nnot json\n', "t.jsonl:2: not a JSON object"),
        ('{"task_id": "a", "input": "text"}\n', "t.jsonl:1: task field 'input'"),
        ("[1, 2]\n", "t.jsonl:1: a task must be a JSON object"),
        ("\n", "no tasks in the file"),
    ],
)
def test_bad_task_files_name_the_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "t.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        read_tasks(tmp_path / "t.jsonl")


def test_nonsense_values_are_all_reported_with_suggestions() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.group_size=1", "train.lr=0", "train.steps=0", "train.bach_groups=2",
                           "eval.n_heldout=-1", "controller.concurrency=0"])  # fmt: skip
    text = str(e.value)
    assert text.startswith("6 config errors")
    for part in ("train.group_size", "train.lr", "train.steps", "eval.n_heldout", "controller.concurrency",
                 "train.bach_groups: unknown key; did you mean 'batch_groups'?"):  # fmt: skip
        assert part in text
    with pytest.raises(ConfigError, match="no longer a config key"):
        load_config(None, ["example=calc"])


def test_missing_files_and_bad_targets(project: Path) -> None:
    path = project / "config.yaml"
    with pytest.raises(ConfigError, match=r"harness.command: file .*nothere.py not found"):
        load_config(path, ["harness.command=[python, nothere.py]"])
    with pytest.raises(ConfigError, match="program 'no-such-program-xyz' not found"):
        load_config(path, ["harness.command=[no-such-program-xyz]"])
    with pytest.raises(ConfigError, match=r"tasks.train: .*missing.jsonl not found"):
        load_config(path, ["tasks.train=missing.jsonl"])
    with pytest.raises(ConfigError, match="module:function"):
        load_config(path, ["grader.python=grader.grade"])
    with pytest.raises(ConfigError, match="has no 'nope'; it has: broken, grade"):
        resolve_project(load_config(path, ["grader.python=grader:nope"]))
    with pytest.raises(ConfigError, match="OPENAI_API_KEY: set by the controller"):
        load_config(path, ["harness.env={OPENAI_API_KEY: x}"])
    with pytest.raises(ConfigError, match="does not say how to run"):
        resolve_project(load_config(None, []))


def test_grader_return_values() -> None:
    assert as_reward(1) == RewardIn(value=1.0)
    assert as_reward((0.5, {"why": "half"})) == RewardIn(value=0.5, details={"why": "half"})
    assert as_reward(RewardIn(value=0.25)).value == 0.25
    for bad in (math.nan, math.inf, "1.0", None, True, (1.0, 2.0)):
        with pytest.raises(GraderError):
            as_reward(bad)


def test_fresh_refuses_a_folder_that_holds_no_run(project: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    code = cli(["train", "--config", str(project / "config.yaml"), f"run_dir={precious}", "--fresh"])
    assert code == 2 and (precious / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in precious.iterdir()) == ["thesis.tex"]


def test_a_preload_that_does_not_import_is_one_line_not_a_traceback(
    project: Path, engine_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli(["check", "--config", str(project / "config.yaml"), f"engine.model={engine_tiny_dir}",
                f"run_dir={tmp_path / 'run'}", "controller.sandbox=false", "controller.fork_server=true",
                "controller.preload=[harnessrl.preload_openaii]"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "preload 'harnessrl.preload_openaii': ModuleNotFoundError" in err and "Traceback" not in err


def test_rerun_with_another_config_refuses_and_shows_the_difference(project: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(project / "config.yaml", [f"run_dir={run_dir}"])
    prepare(run_dir, cfg, Mode.NEW)
    (run_dir / "store.sqlite").write_text("calls")
    other = load_config(project / "config.yaml", [f"run_dir={run_dir}", "train.lr=0.5"])
    assert config_diff(json.loads((run_dir / "config.json").read_text()), other) == ["train.lr: 1e-05 -> 0.5"]
    with pytest.raises(RunDirError, match=r"different config:\n  train.lr: 1e-05 -> 0.5\nPass --resume"):
        prepare(run_dir, other, Mode.NEW)
    with pytest.raises(RunDirError, match=r"cannot resume (.|\n)* train.lr"):
        prepare(run_dir, other, Mode.RESUME)
    longer = load_config(project / "config.yaml", [f"run_dir={run_dir}", "train.steps=40"])
    prepare(run_dir, longer, Mode.RESUME)  # more steps: allowed
    assert (run_dir / "store.sqlite").read_text() == "calls"
    assert prepare(run_dir, longer, Mode.REPLACE) == [
        f"moved the earlier run in {run_dir} to {run_dir}.previous (use --resume to continue it instead)"
    ]
    assert (tmp_path / "run.previous" / "store.sqlite").read_text() == "calls"
    prepare(run_dir, longer, Mode.FRESH)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "run.json"]


def test_init_writes_a_project_and_never_overwrites(tmp_path: Path) -> None:
    written = init_project(tmp_path / "agent")
    assert sorted(p.name for p in written) == ["config.yaml", "grader.py", "harness.py", "tasks.jsonl"]
    code = (tmp_path / "agent" / "harness.py").read_text()
    assert "import harnessrl" not in code and "from harnessrl" not in code
    cfg = load_config(tmp_path / "agent" / "config.yaml")
    train, held = resolve_project(cfg).splits(cfg)
    assert len(train) + len(held) == 80 and len(held) == 16
    with pytest.raises(ScaffoldError, match="already exist"):
        init_project(tmp_path / "agent")


# ---- real harness subprocesses through a real gateway and engine ----

CRASHING = "import sys\nprint('loading my agent...', file=sys.stderr)\nraise ImportError('no module named my_llm_lib')\n"


async def test_preflight_reports_a_harness_that_crashes_at_start(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    gw = make_gateway()
    (tmp_path / "agent.py").write_text(CRASHING)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec([sys.executable, str(tmp_path / "agent.py")], timeout_s=30),
                     lambda task, result: 1.0, tmp_path / "run", max_attempts=1)  # fmt: skip
    try:
        report = await preflight(ctl, client, Task(task_id="t0", input={}), "r", tmp_path / "run")
    finally:
        await client.aclose()
    assert not report.ok and report.exit_code == 1 and report.calls == 0
    assert "ImportError: no module named my_llm_lib" in report.stderr_tail
    assert any("made no model call" in p for p in report.problems)
    assert "no module named my_llm_lib" in report.render() and "FAILED" in report.render()


async def test_a_raising_grader_is_a_grader_error_not_a_score(
    make_gateway: Callable[..., GatewayHandle], project: Path, tmp_path: Path
) -> None:
    gw = make_gateway()
    cfg = load_config(project / "config.yaml", ["grader.python=grader:broken"])
    p = resolve_project(cfg)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, p.harness_spec(30), p.grader, tmp_path / "run", max_attempts=1)
    try:
        (out,) = await ctl.run([RolloutRequest(Task(task_id="t1", input={}), client_id="c1")])
        report = await preflight(ctl, client, Task(task_id="t2", input={}), "r", tmp_path / "run")
    finally:
        await client.aclose()
    assert (out.state, out.reward, out.failure) == (RolloutState.FAILED, None, "grader")
    assert "ZeroDivisionError: grader bug on t1" in (out.error or "")
    workdir = tmp_path / "run" / "rollouts" / out.rollout_id / "attempt-0"
    assert "grader bug on t1" in (workdir / "grader_error.txt").read_text()
    assert (workdir / "home" / "prompt.txt").read_text() == "be brief"  # harness.files: in home/, the cwd
    assert gw.store.get_reward(out.rollout_id) is None
    assert any(x.startswith("the grader failed") for x in report.problems)


async def test_cancelled_rollouts_of_an_interrupted_step_run_again(
    make_gateway: Callable[..., GatewayHandle], project: Path, tmp_path: Path
) -> None:
    gw = make_gateway()
    p = resolve_project(load_config(project / "config.yaml"))
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, p.harness_spec(30), p.grader, tmp_path / "run")
    reqs = [
        RolloutRequest(Task(task_id=f"t{i}", input={}), client_id=f"s1-{i}", group_id="g") for i in range(4)
    ]
    try:
        first = await ctl.run(reqs[:2])  # finished before the interruption
        for r in reqs[2:]:  # started, then cancelled by Ctrl-C
            created = await client.create_rollout(_create(r))
            await client.set_state(created.rollout.rollout_id, RolloutState.CANCELLED)
        again = await ctl.run(reqs)
    finally:
        await client.aclose()
    assert [o.rollout_id for o in again[:2]] == [o.rollout_id for o in first]  # kept, not rerun
    assert all(o.state == RolloutState.SUCCEEDED and o.reward == 1.0 for o in again)
    assert [gw.store.get_rollout(o.rollout_id).client_id for o in again[2:]] == ["s1-2~r1", "s1-3~r1"]


def _create(req: RolloutRequest):  # type: ignore[no-untyped-def]
    from harnessrl.schema import RolloutCreate

    return RolloutCreate(client_id=req.client_id, task_id=req.task.task_id, group_id=req.group_id)


def test_config_reference_matches_the_models() -> None:
    from pydantic import BaseModel

    from harnessrl.config.doc import field_comments, render, sections

    doc = Path(__file__).parents[2] / "docs" / "config.md"
    assert doc.read_text() == render(), (
        "docs/config.md is stale: python -m harnessrl.config.doc > docs/config.md"
    )
    for key, model in sections():
        comments = field_comments(model)
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                continue  # a section: documented by its own table
            assert comments.get(name), f"{key}.{name} has no comment in config.py"
