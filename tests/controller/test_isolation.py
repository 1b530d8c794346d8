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
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.config import load_config
from harnessrl.controller import (
    ForkServerRunner,
    HarnessSpec,
    LocalRunner,
    Runner,
    SandboxedForkServerRunner,
    SandboxRunner,
)
from harnessrl.controller.factory import make_runner
from harnessrl.controller.isolation import (
    REMOVED_NOTE,
    clean_output,
    protect_run_dir,
    unreachable,
)
from harnessrl.controller.runner import AttemptResult, AttemptSpec
from harnessrl.services import Service, free_port, start_gateway

ROOT = os.geteuid() == 0
# An interpreter an unprivileged uid can run: this one, unless it lives under a 0700 directory (this
# project's machines keep it under /root), then the system's.
PYTHON = next((p for p in (sys.executable, "/usr/bin/python3") if os.path.exists(p) and unreachable(p, os.X_OK) is None), None)  # fmt: skip
SECRET = "reference-answer-" + secrets.token_hex(8)

HOSTILE = r"""
import glob, hashlib, hmac, json, os, sqlite3, urllib.error, urllib.request
cfg = json.load(open(os.environ["HARNESSRL_TASK"]))
out = os.environ["HARNESSRL_OUTPUT"]
base = os.environ["OPENAI_BASE_URL"].removesuffix("/v1")
me, my_key = os.environ["HARNESSRL_ROLLOUT_ID"], os.environ["OPENAI_API_KEY"]
res, found = {"uid": os.getuid()}, {}

def attempt(name, fn):
    try:
        res[name] = {"ok": True, "value": fn()}
    except BaseException as e:
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

def http(method, path, body, key):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method=method,
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=30).status

def read_secret():
    db = sqlite3.connect(f"file:{cfg['store']}?mode=ro", uri=True)
    found["secret"] = db.execute("SELECT value FROM meta WHERE key = 'key_secret'").fetchone()[0]
    return "got the key secret"

def scan_environs():
    readable = 0
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            data = open(path, "rb").read()
        except OSError:
            continue
        readable += 1
        for var in data.split(b"\0"):
            name, _, value = var.decode(errors="replace").partition("=")
            if name == "HARNESSRL_ADMIN_KEY":
                found["admin"] = value
            if name == "OPENAI_API_KEY" and value != my_key:
                found["other_key"] = value
    if not found:
        raise LookupError(f"no admin key or other key in the {readable} environments it could read")
    return sorted(found)

def gateway_environ():
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            cmdline = open(path, "rb").read()
        except OSError:
            continue
        if b"harnessrl.gateway" in cmdline:
            return open(path.replace("cmdline", "environ"), "rb").read().decode(errors="replace")
    raise LookupError("no gateway process in sight")

def other_key():
    if "other_key" in found:
        return found["other_key"]
    if "secret" in found:
        mac = hmac.new(found["secret"].encode(), cfg["victim"].encode(), hashlib.sha256).hexdigest()[:32]
        return f"hrl-{cfg['victim']}-{mac}"
    return open(os.path.join(cfg["victim_dir"], "task.json")).read()

attempt("read store", lambda: open(cfg["store"], "rb").read(100).hex())
attempt("read key secret", read_secret)
attempt("list run dir", lambda: os.listdir(cfg["run_dir"]))
attempt("read run log", lambda: open(os.path.join(cfg["run_dir"], "logs", "gateway.log")).read()[-200:])
attempt("read references", lambda: open(cfg["secret_file"]).read())
attempt("scan environs", scan_environs)
attempt("read gateway environ", gateway_environ)
attempt("read parent environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read().decode())
admin = found.get("admin", my_key)
attempt("write own reward", lambda: http("PUT", f"/control/rollouts/{me}/reward", {"value": 1.0}, admin))
attempt("cancel other rollout", lambda: http("POST", f"/control/rollouts/{cfg['victim']}/state",
                                             {"state": "cancelled"}, admin))
attempt("self reward", lambda: http("PUT", "/v1/harnessrl/reward", {"value": 1.0}, my_key))
attempt("read other folder", lambda: os.listdir(cfg["victim_dir"]))
attempt("get other key", other_key)
forged = res["get other key"]["value"] if res["get other key"]["ok"] else f"hrl-{cfg['victim']}-{'0' * 32}"
chat = {"model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
attempt("call as other rollout", lambda: http("POST", "/v1/chat/completions", chat, forged))
for path in cfg["write_targets"]:
    attempt(f"write {path}", lambda p=path: open(p, "w").write("escaped"))
attempt("plant symlink", lambda: os.symlink(cfg["secret_file"], os.path.join(out, "answer.json")))
attempt("plant hard link", lambda: os.link(cfg["secret_file"], os.path.join(out, "hard.json")))
attempt("plant fifo", lambda: os.mkfifo(os.path.join(out, "fifo.json")))
attempt("engine port", lambda: urllib.request.urlopen(cfg["engine_url"] + "/health", timeout=5).status)
attempt("own model call", lambda: http("POST", "/v1/chat/completions", chat, my_key))
res["found"] = sorted(found)
json.dump(res, open(os.path.join(out, "probe.json"), "w"), indent=1)
"""

VICTIM = r"""
import os, time
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "started"), "w").write("1")
time.sleep(120)
"""


@dataclass
class Run:
    """A run directory with a gateway process over its store, and the secrets a harness must not get."""

    run_dir: Path
    gateway: Service
    admin_key: str
    engine_url: str

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, headers={"Authorization": f"Bearer {self.admin_key}"},
                            timeout=60)  # fmt: skip

    def new_rollout(self) -> tuple[str, str]:
        """A rollout with a started attempt: (rollout_id, key)."""
        with self.admin() as c:
            r = c.post("/control/rollouts", json={"client_id": secrets.token_hex(6), "task_id": "t"})
            r.raise_for_status()
            rid = r.json()["rollout"]["rollout_id"]
            c.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
            return rid, r.json()["api_key"]

    def rollout(self, rid: str) -> dict[str, Any]:
        with self.admin() as c:
            r = c.get(f"/control/rollouts/{rid}")
            r.raise_for_status()
            return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run(engine: Service) -> Iterator[Run]:
    """A run directory laid out as a run's (store, logs, tasks with references, rollouts/) with a real
    gateway process (its admin key in its environment, as `harnessrl train` starts it)."""
    run_dir = Path(tempfile.mkdtemp(prefix="harnessrl-isolation-", dir="/tmp"))
    (run_dir / "data").mkdir()
    (run_dir / "data" / "heldout.jsonl").write_text(json.dumps({"reference": SECRET}) + "\n")
    admin_key = "admin-" + secrets.token_hex(12)
    gateway = start_gateway(run_dir / "store.sqlite", engine.url, free_port(), admin_key, run_dir / "logs", 8)
    try:
        gateway.wait_healthy(120)
        protect_run_dir(run_dir)
        yield Run(run_dir, gateway, admin_key, engine.url)
    finally:
        gateway.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o644)
    return path


async def _attack(run: Run, runner: Runner, name: str) -> tuple[str, str, AttemptResult, dict[str, Any]]:
    """Run the victim, then the hostile harness beside it; (hostile id, victim id, result, probe)."""
    assert PYTHON is not None
    scripts = run.run_dir.parent / f"{run.run_dir.name}-scripts-{name}"
    hostile = _write(scripts / "hostile.py", HOSTILE)
    victim_py = _write(scripts / "victim.py", VICTIM)
    scripts.chmod(0o755)
    victim, victim_key = run.new_rollout()
    rollouts = run.run_dir / "rollouts"
    victim_spec = AttemptSpec(victim, 0, victim_key, run.gateway.url, {}, rollouts / victim / "attempt-0")
    victim_task = asyncio.create_task(
        runner.run(victim_spec, HarnessSpec([PYTHON, str(victim_py)], timeout_s=120))
    )
    try:
        for _ in range(600):
            if (victim_spec.workdir / "output" / "started").exists() or victim_task.done():
                break
            await asyncio.sleep(0.05)
        assert (victim_spec.workdir / "output" / "started").exists(), (
            "the other rollout's harness did not start"
        )
        rid, key = run.new_rollout()
        workdir = rollouts / rid / "attempt-0"
        targets = [run.run_dir / "escape.txt", rollouts / "escape.txt", workdir / "escape.txt",
                   workdir / "task.json", victim_spec.workdir / "output" / "escape.txt", Path("/etc/harnessrl-escape")]  # fmt: skip
        task = {"store": str(run.run_dir / "store.sqlite"), "run_dir": str(run.run_dir), "victim": victim,
                "victim_dir": str(victim_spec.workdir), "secret_file": str(run.run_dir / "data" / "heldout.jsonl"),
                "write_targets": [str(t) for t in targets], "engine_url": run.engine_url}  # fmt: skip
        spec = AttemptSpec(rid, 0, key, run.gateway.url, task, workdir)
        result = await runner.run(spec, HarnessSpec([PYTHON, str(hostile)], timeout_s=120))
    finally:
        victim_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim_task
        shutil.rmtree(scripts, ignore_errors=True)
    assert result.infra_error is None and result.exit_code == 0, result.stderr_tail
    written = [t for t in targets[:3] + targets[4:] if t.exists()]
    for t in written:
        t.unlink()  # a failing run must not leave /etc/harnessrl-escape behind
    assert not written, f"written by the harness: {written}"
    assert json.loads((workdir / "task.json").read_text()) == task
    return rid, victim, result, json.loads((result.output_dir / "probe.json").read_text())


def _check_contained(run: Run, rid: str, victim: str, result: AttemptResult, probe: dict[str, Any]) -> None:
    """Every try of the hostile harness failed; its own model call worked; nothing it planted is left."""
    must_fail = ["read store", "read key secret", "read run log", "read references",
                 "scan environs", "read gateway environ", "read parent environ", "write own reward",
                 "cancel other rollout", "self reward", "read other folder", "get other key",
                 "call as other rollout", "plant hard link"]  # fmt: skip
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
    runner = make_runner(load_config(None, []).controller)
    if not isinstance(runner, SandboxRunner) and not ROOT:
        pytest.skip("no bubblewrap here and not root: nothing is enforced (docs/security.md)")
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
    assert PYTHON is not None
    runner = make_runner(load_config(None, ["controller.fork_server=true"]).controller)
    if not isinstance(runner, SandboxedForkServerRunner):
        pytest.skip("no bubblewrap here")
    runner = SandboxedForkServerRunner(runner.sandbox, python=PYTHON)  # an interpreter the uid can run
    try:
        rid, victim, result, probe = await _attack(run, runner, "sandbox-fork")
    finally:
        runner.close()
    assert runner.starts == 2  # forked, no fallback to the exec sandbox: a zygote per harness script
    # (victim.py, hostile.py); attempts of one zygote against each other: test_sandbox_fork.py
    assert probe["uid"] >= 2_000_000
    _check_contained(run, rid, victim, result, probe)
    assert not probe["engine port"]["ok"]  # only the gateway is reachable from the sandbox
    assert "no gateway process in sight" in probe["read gateway environ"]["error"]


@pytest.mark.skipif(not ROOT, reason="a uid of its own for the harness needs root")
@pytest.mark.skipif(PYTHON is None, reason="no Python interpreter that an unprivileged uid can run")
@pytest.mark.parametrize("kind", ["plain", "fork-server"])
async def test_the_plain_runner_as_root_contains_a_hostile_harness(run: Run, kind: str) -> None:
    """`controller.sandbox: false` as root: the harness runs under a uid of its own."""
    assert PYTHON is not None
    cfg = load_config(None, ["controller.sandbox=false", f"controller.fork_server={kind == 'fork-server'}"])
    runner = make_runner(cfg.controller)
    assert type(runner) is (ForkServerRunner if kind == "fork-server" else LocalRunner)
    if isinstance(runner, ForkServerRunner):
        runner = ForkServerRunner(python=PYTHON)  # the config's, with an interpreter the uid can run
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
