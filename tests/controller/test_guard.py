"""Guards (controller/guard.py): a hostile harness (a real subprocess) that edits read-only files, reads
hidden `.git` and calls out of its allowlist is blocked by the bubblewrap sandbox and flagged by the
runners that cannot block it (plain subprocess, fork server, the Ray task body on its node); a guard a
runner cannot enforce stops the run before it starts; the flag lands in the reward's details."""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.adapter import build_batch
from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.guard import (
    GuardUnenforceable,
    ReadOnlyWatch,
    _inside,
    changed,
    matched,
    snapshot,
)
from harnessrl.controller.runner import AttemptResult, AttemptSpec
from harnessrl.controller.runners.egress import hosts_text, plan
from harnessrl.controller.runners.forkserver import ForkServerRunner
from harnessrl.controller.runners.local import LocalRunner
from harnessrl.controller.runners.ray_runner import RayRunner, RaySpec, run_on_node
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec, bwrap_problem
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import (
    AttemptFinish,
    AttemptStatus,
    GuardPolicy,
    RewardIn,
    RolloutCreate,
    RolloutState,
    Task,
)
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer

TEST_FILE = "repo/tests/test_mod.py"
WORKSPACE = {"repo/mod.py": "def f():\n    return 1\n", TEST_FILE: "def test_f():\n    assert False\n",
             "repo/.git/config": "[core]\n secret = the-fix-is-in-HEAD~1\n"}  # fmt: skip

HOSTILE = r"""
import json, os, socket
cfg = json.load(open(os.environ["HARNESSRL_TASK"]))
res = {}
def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
def echo(host, port):
    with socket.create_connection((host, port), timeout=3) as s:
        s.sendall(b"ping")
        return s.recv(4).decode()
attempt("edit tests", lambda: open("repo/tests/test_mod.py", "w").write("def test_f():\n    assert True\n"))
attempt("add test", lambda: open("repo/tests/conftest.py", "w").write("collect_ignore = ['x']\n"))
attempt("read git", lambda: open("repo/.git/config").read())
attempt("edit source", lambda: open("repo/mod.py", "w").write("def f():\n    return 2\n"))
def own_reward(value):
    import urllib.request
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/harnessrl/reward", method="PUT",
                                 data=json.dumps({"value": value}).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=10).status
if "self_reward" in cfg:
    attempt("self reward", lambda: own_reward(cfg["self_reward"]))
for name, (host, port) in cfg.get("connect", {}).items():
    attempt(name, lambda h=host, p=port: echo(h, p))
json.dump(res, open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "probe.json"), "w"))
"""


def _prepare(tmp_path: Path, name: str) -> tuple[Path, HarnessSpec]:
    """An attempt folder with the workspace in its home/, and the hostile harness."""
    workdir = tmp_path / name / "attempt"
    for rel, text in WORKSPACE.items():
        (workdir / "home" / rel).parent.mkdir(parents=True, exist_ok=True)
        (workdir / "home" / rel).write_text(text)
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    return workdir, HarnessSpec([sys.executable, str(script)], timeout_s=60)


def _probe(result: AttemptResult) -> dict[str, dict[str, object]]:
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    return json.loads((result.output_dir / "probe.json").read_text())  # type: ignore[no-any-return]


READ_ONLY = GuardPolicy(read_only=["repo/tests"])
FLAGGED = {"read_only_changed": {"modified": [TEST_FILE], "added": ["repo/tests/conftest.py"]}}


# --- pure parts -----------------------------------------------------------------------------------


def test_policy_checks_and_merges() -> None:
    for bad in (
        {"egress": ["pypi.org"]},
        {"egress": ["pypi.org:0"]},
        {"read_only": ["../x"]},
        {"read_only": ["/etc"]},
    ):
        with pytest.raises(ValueError, match="guard"):
            GuardPolicy.model_validate(bad)
    with pytest.raises(ValueError, match="workspace"):
        Task(task_id="t", input={}, workspace={"../escape": "x"})
    a = GuardPolicy(hidden=["**/.git"], no_git=True)
    both = a.merged(GuardPolicy(hidden=["**/.git", "secret"], read_only=["tests"]))
    assert both == GuardPolicy(hidden=["**/.git", "secret"], read_only=["tests"], no_git=True)
    assert GuardPolicy().empty and not a.empty


def test_snapshot_sees_edits_additions_removals_and_links(tmp_path: Path) -> None:
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    (tmp_path / "repo" / "tests" / "a.py").write_text("a")
    (tmp_path / "repo" / "tests" / "b.py").write_text("b")
    before = snapshot(tmp_path, ["repo/tests"])
    assert set(before) == {"repo/tests", "repo/tests/a.py", "repo/tests/b.py"}
    (tmp_path / "repo" / "tests" / "a.py").write_text("A")
    (tmp_path / "repo" / "tests" / "b.py").unlink()
    (tmp_path / "repo" / "tests" / "c.py").symlink_to("/etc/passwd")
    assert changed(before, snapshot(tmp_path, ["repo/tests"])) == {
        "modified": ["repo/tests/a.py"], "removed": ["repo/tests/b.py"], "added": ["repo/tests/c.py"]}  # fmt: skip
    assert changed(before, before) == {}


def test_inside_compares_path_components_not_string_prefixes(tmp_path: Path) -> None:
    home, twin = tmp_path / "home", tmp_path / "home2"
    for d in (home / "repo", twin):
        d.mkdir(parents=True)
    (twin / "secret").write_text("s")
    assert _inside(home / "repo" / "x", home) and _inside(home / "x", home)
    assert not _inside(twin / "secret", home)  # `/x/home2` is not inside `/x/home`
    (home / "out").symlink_to(twin)  # a link from home/ into its twin: not followed out
    assert not _inside(home / "out" / "secret", home) and matched(home, ["out/*"]) == []


def test_watch_restores_what_an_attempt_changed_and_writes_through_no_link(tmp_path: Path) -> None:
    home, outside = tmp_path / "w" / "home", tmp_path / "outside"
    (home / "repo" / "tests" / "sub").mkdir(parents=True)
    outside.mkdir()
    (home / "repo/tests/a.py").write_text("a")
    (home / "repo/tests/sub/b.py").write_text("b")
    (home / "repo/tests/run.sh").write_text("#!/bin/sh\n")
    (home / "repo/tests/run.sh").chmod(0o755)
    watch = ReadOnlyWatch(GuardPolicy(read_only=["repo/tests"]), tmp_path / "w")
    (home / "repo/tests/a.py").write_text("A")
    (home / "repo/tests/run.sh").unlink()
    (home / "repo/tests/sub/b.py").unlink()
    (home / "repo/tests/sub").rmdir()
    (home / "repo/tests/sub").symlink_to(outside)  # a folder swapped for a link out of home/
    (home / "repo/tests/new").mkdir()
    (home / "repo/tests/new/c.py").write_text("c")
    found = watch.findings()
    assert found is not None and "not_restored" not in found
    assert found["read_only_changed"]["added"] == ["repo/tests/new", "repo/tests/new/c.py"]
    assert snapshot(home, ["repo/tests"]) == watch.before  # every file, mode and folder as it was
    assert (home / "repo/tests/run.sh").stat().st_mode & 0o777 == 0o755
    assert list(outside.iterdir()) == [] and not (home / "repo/tests/sub").is_symlink()
    # a parent above the read-only path turned into a link: nothing is written through it, and it is said
    watch = ReadOnlyWatch(GuardPolicy(read_only=["repo/tests"]), tmp_path / "w")
    (home / "repo").rename(tmp_path / "moved")
    (home / "repo").symlink_to(outside)
    found = watch.findings()
    assert found is not None and "repo/tests/a.py" in found["not_restored"] and list(outside.iterdir()) == []


def test_egress_plan_maps_names_to_loopback_and_refuses_what_cannot_be_relayed(tmp_path: Path) -> None:
    fw = plan(
        ["pypi.org:443", "127.0.0.1:5432", "files.pythonhosted.org:443", "pypi.org:80"], gateway_port=8000
    )
    assert [(f.host, f.port, f.inside) for f in fw] == [("pypi.org", 443, "127.0.0.2"),
        ("127.0.0.1", 5432, "127.0.0.1"), ("files.pythonhosted.org", 443, "127.0.0.3"), ("pypi.org", 80, "127.0.0.2")]  # fmt: skip
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    assert hosts_text(fw, tmp_path / "hosts") == (
        "127.0.0.2 pypi.org\n127.0.0.3 files.pythonhosted.org\n127.0.0.1 localhost\n"
    )
    with pytest.raises(ValueError, match="only a host name"):
        plan(["10.0.0.5:5432"])
    with pytest.raises(ValueError, match="gateway"):
        plan(["localhost:8000"], gateway_port=8000)
    assert SandboxRunner().guard_problem(GuardPolicy(egress=["10.0.0.5:80"])) is not None
    assert (
        SandboxRunner().guard_problem(GuardPolicy(hidden=["x"], egress=["pypi.org:443"], no_git=True)) is None
    )


def test_which_runner_accepts_which_guard() -> None:
    hidden, egress = GuardPolicy(hidden=["**/.git"]), GuardPolicy(egress=["pypi.org:443"])
    for runner in (LocalRunner(), ForkServerRunner(), RayRunner(RaySpec())):
        assert runner.guard_problem(READ_ONLY) is None  # checked after the attempt
        for g in (hidden, egress, GuardPolicy(no_git=True)):
            assert "cannot enforce" in (runner.guard_problem(g) or "")
    assert RayRunner(RaySpec(sandbox=SandboxSpec())).guard_problem(hidden) is None  # as its inner runner
    assert SandboxedForkServerRunner(SandboxSpec()).guard_problem(hidden) is None  # guarded: exec sandbox


# --- plain runners: flagged -----------------------------------------------------------------------


async def test_local_runner_flags_edited_read_only_files(tmp_path: Path) -> None:
    workdir, harness = _prepare(tmp_path, "local")
    spec = AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {}, workdir, guard=READ_ONLY)
    result = await LocalRunner().run(spec, harness)
    probe = _probe(result)
    assert probe["edit tests"]["ok"] and probe["edit source"]["ok"]  # nothing blocks it here...
    assert result.guard_findings == FLAGGED  # ...but it is seen, and undone before any grader reads home/
    home = workdir / "home"
    assert (home / TEST_FILE).read_text() == WORKSPACE[TEST_FILE]
    assert not (home / "repo/tests/conftest.py").exists()
    assert (
        home / "repo/mod.py"
    ).read_text() == "def f():\n    return 2\n"  # not read-only: the harness's work
    clean = await LocalRunner().run(AttemptSpec("r2", 0, "k", "http://127.0.0.1:9", {}, _prepare(tmp_path, "clean")[0],
                                                guard=GuardPolicy(read_only=["repo/other"])), harness)  # fmt: skip
    assert _probe(clean)["edit tests"]["ok"] and clean.guard_findings is None


async def test_fork_server_runner_flags_edited_read_only_files(tmp_path: Path) -> None:
    workdir, harness = _prepare(tmp_path, "fork")
    runner = ForkServerRunner()
    await runner.start()
    try:
        result = await runner.run(
            AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {}, workdir, guard=READ_ONLY), harness
        )
    finally:
        runner.close()
    assert _probe(result)["edit tests"]["ok"] and result.guard_findings == FLAGGED
    assert (workdir / "home" / TEST_FILE).read_text() == WORKSPACE[TEST_FILE]


def test_ray_task_body_flags_edited_read_only_files(tmp_path: Path) -> None:
    """The body of the Ray task on its node (plain inner runner): the finding comes back with it."""
    from harnessrl.controller.runner import pack_home

    workdir, harness = _prepare(tmp_path, "ray")
    spec = AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {}, tmp_path / "controller-side", guard=READ_ONLY)
    node = run_on_node(spec, harness, RaySpec(node_workdir=str(tmp_path / "node")), "n1", pack_home(workdir))
    assert node.infra_error is None and node.exit_code == 0, node.stderr_tail
    assert json.loads(node.files["probe.json"])["edit tests"]["ok"] and node.guard_findings == FLAGGED


# --- through the controller: flagged in the reward, counted; refused before the run --------------


def _grade(task: Task, result: AttemptResult) -> RewardIn:
    """A grader that trusts the test file: an edited one would raise the reward; it says what it read."""
    edited = "assert True" in (result.output_dir.parent / "home" / TEST_FILE).read_text()
    return RewardIn(value=1.0 if edited else 0.5, details={"read_edited_test": edited})


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[ControlClient, str, SQLiteStore]]:
    store = SQLiteStore(tmp_path / "store.sqlite")
    admin = "admin-" + secrets.token_hex(8)
    app = create_app(GatewayConfig(admin_key=admin, upstream_url="http://127.0.0.1:9"), store)
    with ThreadServer(app) as gw:
        yield ControlClient(gw.url, admin), gw.url, store
    store.close()


@pytest.mark.parametrize("on_violation", [None, "drop", "flag"])
async def test_a_tampering_harness_on_the_plain_runner_is_zeroed_dropped_or_flagged(
    tmp_path: Path, gateway: tuple[ControlClient, str, SQLiteStore], on_violation: str | None
) -> None:
    client, url, store = gateway
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    policy = (
        READ_ONLY
        if on_violation is None
        else GuardPolicy(read_only=["repo/tests"], on_violation=on_violation)
    )
    # the task lets its harness write its own reward, and the harness gives itself 1.0: a violation voids that
    task = Task(
        task_id="t1", input={"self_reward": 1.0}, workspace=WORKSPACE, guard=policy, allow_self_reward=True
    )
    harness = HarnessSpec([sys.executable, str(script)], timeout_s=60)
    try:
        hidden = Controller(
            client, url, harness, _grade, tmp_path / "refused", guard=GuardPolicy(hidden=["**/.git"])
        )
        with pytest.raises(GuardUnenforceable, match=r"task 't1' declares a guard: .*hidden"):
            await hidden.run([RolloutRequest(task, "c0")])
        assert store.query("SELECT COUNT(*) FROM rollouts") == [(0,)]  # nothing started
        run_guard = None if on_violation is None else GuardPolicy(on_violation="zero")  # the task's wins
        ctl = Controller(client, url, harness, _grade, tmp_path / "run", guard=run_guard)
        (outcome,) = await ctl.run([RolloutRequest(task, "c1", group_id="g")])
        detail = await client.rollout(outcome.rollout_id)
    finally:
        await client.aclose()
    assert detail.reward is not None and detail.reward.details["hacking"] == {"guard": FLAGGED}
    assert detail.reward.details["read_edited_test"] is False  # the grader read the original test file
    probe = json.loads(
        (tmp_path / "run/rollouts" / outcome.rollout_id / "attempt-0/output/probe.json").read_text()
    )
    saved = tmp_path / "run/rollouts" / outcome.rollout_id / "attempt-0/guard_findings.json"
    assert json.loads(saved.read_text()) == FLAGGED  # for a regrade after a restart
    assert probe["self reward"] == {"ok": True, "value": 200}  # its own 1.0 was stored, then graded over
    assert detail.reward.details["guard"] == {"on_violation": on_violation or "zero", "graded": 0.5}
    if on_violation == "drop":  # graded, recorded, but out of the batch
        assert outcome.state == RolloutState.FAILED and outcome.failure == "guard" and outcome.reward is None
        assert build_batch([detail]).rewards == {}
        from harnessrl.trainer.loop import batch_metrics  # (torch: imported only here)

        assert batch_metrics(build_batch([detail]), [outcome])["rollouts_guard_dropped"] == 1
        return
    assert outcome.state == RolloutState.SUCCEEDED
    assert outcome.reward == (
        0.5 if on_violation == "flag" else 0.0
    )  # the task's own policy wins over the run's
    assert build_batch([detail]).flagged_hacking == [outcome.rollout_id]


async def test_a_restarted_controller_still_zeroes_a_violation(
    tmp_path: Path, gateway: tuple[ControlClient, str, SQLiteStore]
) -> None:
    """A controller killed between an attempt's end and its grading: the restarted one grades the attempt
    from its files, and the guard findings saved beside them still cost the reward."""
    client, url, _ = gateway
    task = Task(task_id="t1", input={}, guard=READ_ONLY)
    try:
        rid = (
            await client.create_rollout(RolloutCreate(client_id="c1", task_id="t1", input={}))
        ).rollout.rollout_id
        attempt = (await client.start_attempt(rid)).attempt
        workdir = tmp_path / "run" / "rollouts" / rid / f"attempt-{attempt}"
        (workdir / "home" / TEST_FILE).parent.mkdir(parents=True)
        (workdir / "home" / TEST_FILE).write_text(WORKSPACE[TEST_FILE])  # restored by the dead controller
        (workdir / "output").mkdir()
        (workdir / "guard_findings.json").write_text(json.dumps(FLAGGED))
        await client.finish_attempt(rid, attempt, AttemptFinish(status=AttemptStatus.EXITED, exit_code=0))
        ctl = Controller(
            client, url, HarnessSpec([sys.executable, "-c", "pass"], timeout_s=30), _grade, tmp_path / "run"
        )
        (outcome,) = await ctl.run([RolloutRequest(task, "c1")])
        detail = await client.rollout(rid)
    finally:
        await client.aclose()
    assert outcome.state == RolloutState.SUCCEEDED and outcome.reward == 0.0 and len(detail.attempts) == 1
    assert detail.reward is not None and detail.reward.details["hacking"] == {"guard": FLAGGED}


# --- the sandbox: blocked -------------------------------------------------------------------------

_BWRAP = bwrap_problem()


@pytest.fixture
def echo_servers() -> Iterator[tuple[int, int]]:
    """Two TCP echo servers on this machine (all addresses): one allowed, one not."""
    servers = [socket.create_server(("0.0.0.0", 0)) for _ in range(2)]

    def serve(srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(4))

    for srv in servers:
        threading.Thread(target=serve, args=(srv,), daemon=True).start()
    yield servers[0].getsockname()[1], servers[1].getsockname()[1]
    for srv in servers:
        srv.close()


@pytest.mark.skipif(_BWRAP is not None, reason=f"bubblewrap cannot run here: {_BWRAP}")
@pytest.mark.parametrize("runner_kind", ["exec", "fork"])
async def test_sandbox_blocks_edits_hidden_reads_and_unlisted_egress(
    tmp_path: Path, echo_servers: tuple[int, int], runner_kind: str
) -> None:
    """The exec sandbox, and the sandboxed fork server (a guarded task's attempts run in the former)."""
    allowed, denied = echo_servers
    name = socket.gethostname()
    connect = {"allowed": ["127.0.0.1", allowed], "denied": ["127.0.0.1", denied], "by name": [name, allowed]}
    workdir, harness = _prepare(tmp_path, "sandbox")
    guard = GuardPolicy(hidden=["**/.git"], read_only=["repo/tests"], egress=[f"127.0.0.1:{allowed}", f"{name}:{allowed}"])  # fmt: skip
    spec = AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {"connect": connect}, workdir, guard=guard)
    box = SandboxSpec(cgroup="never")
    runner = SandboxRunner(box) if runner_kind == "exec" else SandboxedForkServerRunner(box)
    probe = _probe(await runner.run(spec, harness))
    assert "Read-only file system" in str(probe["edit tests"]["error"]), probe
    assert "Read-only file system" in str(probe["add test"]["error"]), probe
    assert "No such file" in str(probe["read git"]["error"]), probe  # an empty tmpfs over .git
    assert probe["edit source"]["ok"], probe  # the rest of the repository is the harness's
    assert probe["allowed"] == {"ok": True, "value": "ping"}, probe
    assert probe["by name"] == {"ok": True, "value": "ping"}, probe  # the name maps to a relay inside
    assert not probe["denied"]["ok"], probe
    assert (workdir / "home" / TEST_FILE).read_text() == WORKSPACE[TEST_FILE]
    assert (workdir / "home" / "repo" / ".git" / "config").is_file()  # hidden, not removed
