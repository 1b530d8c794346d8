"""A hostile harness against the default runner, the plain runner and the fork server (docs/security.md).

Each attempt runs a harness that tries every way the security probe of issue 18 found to act beyond its
rollout: read the store (the key secret), find the admin key in any process's environment (the
gateway's above all), use what it found on the control API (write its own reward, cancel another
rollout), use another rollout's key, write outside its folder, and leave links in `output/` for the
grader. The gateway is a real process over a real SQLite store in a real run directory (protected as
`isolation.protect_run_dir` leaves it), beside another rollout whose harness is running. Every try must
fail, and the test checks each one; the harness's own model call must still work.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessrl.controller import (
    ForkServerRunner,
    HarnessSpec,
    LocalRunner,
    Runner,
    SandboxedForkServerRunner,
    SandboxRunner,
)
from harnessrl.controller.isolation import REMOVED_NOTE, clean_output
from harnessrl.controller.runner import AttemptResult, AttemptSpec
from harnessrl.services import Service
from tests.support.hostile import (
    MUST_FAIL,
    PYTHON,
    ROOT,
    SECRET,
    Attack,
    Run,
    attack,
    network_isolated,
    open_run,
    own_model_call_ok,
    refusals,
    runner_for,
)
from tests.support.hostile import write_script as _write


@pytest.fixture(scope="module")
def run(engine: Service) -> Iterator[Run]:
    """The run the hostile harness attacks (`tests/support/hostile.py`: a real gateway process over a real
    store in a protected run directory)."""
    with open_run(engine.url) as r:
        yield r


def _runner(kind: str) -> Runner:
    """The runner of `kind`, or a skip saying why it cannot run here."""
    runner = runner_for(kind)
    if isinstance(runner, str):
        pytest.skip(runner)
    return runner


async def _attack(run: Run, runner: Runner, name: str) -> tuple[str, str, AttemptResult, dict[str, Any]]:
    """Run the victim, then the hostile harness beside it; (hostile id, victim id, result, probe)."""
    a = await attack(run, runner, name)
    result = a.result
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    assert not a.written, f"written by the harness: {a.written}"
    assert a.task_after == a.task
    # what the benchmark counts (bench/reliability/hostile.py) agrees with the checks below
    refused = refusals(a, run, network_isolated(runner))
    assert [k for k, ok in refused.items() if not ok] == [] and own_model_call_ok(a)
    return a.rid, a.victim, result, a.probe


def _check_contained(run: Run, rid: str, victim: str, result: AttemptResult, probe: dict[str, Any]) -> None:
    """Every try of the hostile harness failed; its own model call worked; nothing it planted is left."""
    must_fail = list(MUST_FAIL)
    must_fail += [k for k in probe if k.startswith("write /")]
    assert len(must_fail) == 14 + 6
    listing = probe["list run dir"]  # the sandbox shows an empty stand-in on the way to the attempt
    assert not listing["ok"] or listing["value"] == ["rollouts"], listing
    worked = {k: probe[k] for k in must_fail if probe[k]["ok"]}
    assert not worked, f"what the harness should not have done, and did: {worked}"
    assert probe["found"] == [], "the harness found the admin key, the key secret or another rollout's key"
    for k in ("write own reward", "cancel other rollout", "self reward"):
        assert "HTTP Error 403" in probe[k]["error"], (k, probe[k])  # its own key carries no control power
    assert "HTTP Error 401" in probe["call as other rollout"]["error"]  # no key of another rollout works
    assert probe["own model call"] == {"ok": True, "value": 200}, probe["own model call"]
    assert run.rollout(rid)["reward"] is None
    assert run.rollout(victim)["rollout"]["state"] != "cancelled"
    planted = sorted(p.name for p in result.output_dir.iterdir())
    assert planted == ["probe.json"], planted  # the link and the FIFO are gone before any grader looks
    assert probe["plant symlink"]["ok"] and probe["plant fifo"]["ok"]  # its own folder: allowed, then removed
    note = (result.output_dir.parent / REMOVED_NOTE).read_text()
    assert "answer.json: symlink" in note and "fifo.json: not a regular file" in note
    assert "removed 1 symlink(s) and 1 other" in result.stderr_tail
    assert SECRET not in (result.output_dir / "probe.json").read_text()


@pytest.mark.skipif(PYTHON is None, reason="no Python interpreter that an unprivileged uid can run")
async def test_the_default_runner_contains_a_hostile_harness(run: Run) -> None:
    runner = _runner(
        "default"
    )  # skipped without bubblewrap unless root: nothing is enforced (docs/security.md)
    rid, victim, result, probe = await _attack(run, runner, "default")
    _check_contained(run, rid, victim, result, probe)
    if isinstance(runner, SandboxRunner):
        assert not probe["engine port"]["ok"]  # only the gateway is reachable from the sandbox
        assert "no gateway process in sight" in probe["read gateway environ"]["error"]


@pytest.mark.skipif(not ROOT, reason="the sandboxed fork server forks as root (otherwise: the exec sandbox)")
@pytest.mark.skipif(PYTHON is None, reason="no Python interpreter that an unprivileged uid can run")
async def test_the_sandboxed_fork_server_contains_a_hostile_harness(run: Run) -> None:
    """`fork_server: true` under the default `sandbox: auto`: forked inside one bwrap, beside the victim
    forked from the same zygote."""
    runner = _runner("sandbox-fork")  # the config's, with an interpreter the uid can run
    assert isinstance(runner, SandboxedForkServerRunner)
    try:
        rid, victim, result, probe = await _attack(run, runner, "sandbox-fork")
    finally:
        runner.close()
    assert runner.starts == 1  # forked, no fallback to the exec sandbox: one zygote for victim.py and
    # hostile.py (one folder, so one view: sandbox_view.attempt_view); attempts of one zygote against
    # each other: test_sandbox_fork.py
    assert probe["uid"] >= 2_000_000
    _check_contained(run, rid, victim, result, probe)
    assert not probe["engine port"]["ok"]  # only the gateway is reachable from the sandbox
    assert "no gateway process in sight" in probe["read gateway environ"]["error"]


@pytest.mark.skipif(not ROOT, reason="a uid of its own for the harness needs root")
@pytest.mark.skipif(PYTHON is None, reason="no Python interpreter that an unprivileged uid can run")
@pytest.mark.parametrize("kind", ["plain", "fork-server"])
async def test_the_plain_runner_as_root_contains_a_hostile_harness(run: Run, kind: str) -> None:
    """`controller.sandbox: false` as root: the harness runs under a uid of its own."""
    runner = _runner(kind)  # the config's (a fork server with an interpreter the uid can run)
    assert type(runner) is (ForkServerRunner if kind == "fork-server" else LocalRunner)
    try:
        rid, victim, result, probe = await _attack(run, runner, kind)
    finally:
        if isinstance(runner, ForkServerRunner):
            runner.close()
    assert probe["uid"] >= 2_000_000
    for k in ("read store", "read key secret", "read gateway environ", "read other folder"):
        assert "Permission denied" in probe[k]["error"] or "unable to open" in probe[k]["error"], (
            k,
            probe[k],
        )
    _check_contained(run, rid, victim, result, probe)
    workdir = result.output_dir.parent
    assert workdir.stat().st_mode & 0o777 == 0o700 and workdir.stat().st_uid == 0  # closed after the attempt


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder other users can search (pytest's own temporary folders are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="harnessrl-isolation-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(
    not ROOT, reason="as another user, the plain runner has no uid to give (it warns instead)"
)
async def test_a_uid_that_cannot_reach_the_harness_is_reported(open_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A harness under a 0700 directory: "auto" runs it as the controller's user and says so loudly;
    "required" refuses to run it (an infrastructure error naming the directory)."""
    hidden = open_dir / "private"
    script = _write(hidden / "h.py", "import os; open(os.environ['HARNESSRL_OUTPUT'] + '/uid', 'w').write(str(os.getuid()))")  # fmt: skip
    hidden.chmod(0o700)
    workdir = open_dir / "run" / "rollouts" / "r1" / "attempt-0"
    harness = HarnessSpec([PYTHON or sys.executable, str(script)], timeout_s=60)
    spec = AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {}, workdir)
    refused = await LocalRunner(own_uid="required").run(spec, harness)
    assert refused.infra_error is not None and f"{hidden} is not searchable" in refused.infra_error
    shared = await LocalRunner().run(spec, harness)
    assert shared.exit_code == 0 and (shared.output_dir / "uid").read_text() == "0"
    err = capfd.readouterr().err
    assert "WARNING: harnesses run as root, not under a uid of their own" in err and str(hidden) in err


DAEMON = r"""
import os, sys, time
out = os.environ["HARNESSRL_OUTPUT"]
if os.fork() == 0:
    os.setsid()  # out of the attempt's process group
    if os.fork() == 0:
        fd = os.open(out, os.O_RDONLY)  # keeps a handle on output/ whatever happens to the path
        open(os.path.join(out, "daemon.pid"), "w").write(str(os.getpid()))
        for i in range(3000):
            try:
                os.symlink("/etc/shadow", f"late-{i}", dir_fd=fd)
            except OSError:
                pass
            time.sleep(0.01)
    os._exit(0)
time.sleep(0.5)
"""


@pytest.mark.skipif(not ROOT, reason="a uid of its own for the harness needs root")
@pytest.mark.skipif(PYTHON is None, reason="no Python interpreter that an unprivileged uid can run")
async def test_a_daemon_that_left_its_process_group_is_stopped(open_dir: Path) -> None:
    """A harness's daemon (setsid, double fork) is killed with the attempt, and nothing it could
    still do reaches `output/` after the cleaning."""
    assert PYTHON is not None
    script = _write(open_dir / "scripts" / "daemon.py", DAEMON)
    workdir = open_dir / "run" / "rollouts" / "r1" / "attempt-0"
    spec = AttemptSpec("r1", 0, "k", "http://127.0.0.1:9", {}, workdir)
    result = await LocalRunner(own_uid="required").run(spec, HarnessSpec([PYTHON, str(script)], timeout_s=60))
    assert result.exit_code == 0, result.stderr_tail
    pid = int((result.output_dir / "daemon.pid").read_text())
    await asyncio.sleep(0.3)
    assert not Path(f"/proc/{pid}").exists() or "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    assert "symlink" in (workdir / REMOVED_NOTE).read_text()  # what it made before the end: removed
    assert not [p for p in result.output_dir.iterdir() if p.is_symlink()]


def test_clean_output_removes_what_leads_elsewhere(tmp_path: Path) -> None:
    out = tmp_path / "output"
    (out / "sub").mkdir(parents=True)
    secret = _write(tmp_path / "secret.txt", "secret")
    _write(out / "answer.json", "{}")
    os.link(out / "answer.json", out / "sub" / "same.json")  # two names, both inside: kept
    os.link(secret, out / "sub" / "hard.txt")  # a name of a file outside: removed
    os.symlink(secret, out / "link.txt")
    os.symlink(tmp_path, out / "sub" / "dirlink")
    os.mkfifo(out / "fifo")
    removed = clean_output(out)
    assert sorted(removed) == ["fifo: not a regular file or directory (FIFO, socket or device)", "link.txt: symlink",
                               "sub/dirlink: symlink", "sub/hard.txt: hard link (2 names, 1 outside output/)"]  # fmt: skip
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["answer.json", "sub", "sub/same.json"]
    assert secret.read_text() == "secret"  # removing a name never touches the file it named


def test_the_count_of_refusals_names_each_probe_that_worked(run: Run, tmp_path: Path) -> None:
    """What the benchmark reports as allowed: a probe that worked, a key it found, a file left where it
    wrote, a link left in `output/`, a reward that was written (`refusals`)."""
    rid, _ = run.new_rollout()
    victim, _ = run.new_rollout()
    targets = [str(tmp_path / "escape.txt"), str(tmp_path / "task.json")]
    task = {"write_targets": targets}
    probe: dict[str, Any] = {k: {"ok": False, "error": "PermissionError"} for k in MUST_FAIL}
    probe |= {f"write {t}": {"ok": False, "error": "OSError"} for t in targets}
    probe["read store"] = {"ok": True, "value": "53514c69"}
    probe |= {"list run dir": {"ok": True, "value": ["rollouts"]}, "plant symlink": {"ok": True, "value": None},
              "plant fifo": {"ok": True, "value": None}, "engine port": {"ok": True, "value": 200}, "found": ["admin"]}  # fmt: skip
    (tmp_path / "output").mkdir()
    _write(tmp_path / "output" / "answer.json", "{}")  # left for the grader
    result = AttemptResult(0, False, tmp_path / "output", "", "")
    a = Attack(rid, victim, result, probe, task, written=[tmp_path / "escape.txt"], task_after={"changed": 1})
    refused = refusals(a, run, isolated=False)
    assert len(refused) == len(MUST_FAIL) + 2 + 3 and "engine port" not in refused
    allowed = sorted(k for k, ok in refused.items() if not ok)
    assert allowed == sorted(
        ["read store", "scan environs", "plant symlink", *(f"write {t}" for t in targets)]
    )
    assert not refusals(a, run, isolated=True)["engine port"]
    assert not own_model_call_ok(a)
    with run.admin() as c:
        c.put(f"/control/rollouts/{rid}/reward", json={"value": 1.0}).raise_for_status()
    refused = refusals(a, run, isolated=False)
    assert not refused["write own reward"] and not refused["self reward"]


def test_a_warning_reaches_stderr_once_whether_or_not_logging_is_configured() -> None:
    # Before a run's log file exists the harnessrl logger has no handler, and logging's last resort would
    # print the warning a second time beside warn_once's own line.
    code = (
        "import logging, sys\n"
        "from harnessrl.controller.isolation import warn_once\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.getLogger('harnessrl').addHandler(logging.FileHandler(sys.argv[2]))\n"
        "warn_once('e', 'the sandbox is off')\n"
        "warn_once('e', 'the sandbox is off')\n"
    )
    for mode in ("bare", "configured"):
        with tempfile.TemporaryDirectory() as d:
            log_file = os.path.join(d, "log")
            done = subprocess.run(
                [sys.executable, "-c", code, mode, log_file], capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr
            assert done.stderr.count("the sandbox is off") == 1, done.stderr
            if mode == "configured":
                with open(log_file) as f:
                    assert "event=e" in f.read()
