"""A hostile harness and the run it attacks, shared by tests/controller/test_isolation.py and
`python -m bench.reliability.hostile` (docs/security.md).

The harness (`HOSTILE`) tries every way the security probe of issue 18 found to act beyond its rollout:
read the store (the key secret), find the admin key in any process's environment (the gateway's above
all), use what it found on the control API (write its own reward, cancel another rollout), use another
rollout's key, write outside its folder, leave links in `output/` for the grader, reach the engine's
port; and its own model call, which must work. It writes what each try gave to `output/probe.json`.
`open_run` lays out a run directory with a real gateway process over a real SQLite store, protected as
`isolation.protect_run_dir` leaves it; `attack` runs the harness beside another rollout's running
harness; `refusals` says, probe by probe, whether it was refused.
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harnessrl.config import load_config
from harnessrl.controller import (
    ForkServerRunner,
    HarnessSpec,
    Runner,
    SandboxedForkServerRunner,
    SandboxRunner,
)
from harnessrl.controller.factory import make_runner
from harnessrl.controller.isolation import protect_run_dir, unreachable
from harnessrl.controller.runner import AttemptResult, AttemptSpec
from harnessrl.services import Service, free_port, start_gateway
from tests.support.gateway import loopback_tls

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


# The tries that must fail under every runner (the writes outside its folder come on top, one per target).
MUST_FAIL = ("read store", "read key secret", "read run log", "read references", "scan environs",
             "read gateway environ", "read parent environ", "write own reward", "cancel other rollout",
             "self reward", "read other folder", "get other key", "call as other rollout", "plant hard link")  # fmt: skip
# The runners attacked: the default (`sandbox: auto`), the sandboxed fork server, and `sandbox: false`
# as root (a uid of its own), plain and forked.
KINDS = ("default", "sandbox-fork", "plain", "fork-server")


@dataclass
class Run:
    """A run directory with a gateway process over its store, and the secrets a harness must not get."""

    run_dir: Path
    gateway: Service
    admin_key: str
    engine_url: str

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway.url, headers={"Authorization": f"Bearer {self.admin_key}"},
                            timeout=60, verify=loopback_tls())  # fmt: skip

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


@contextmanager
def open_run(engine_url: str) -> Iterator[Run]:
    """A run directory laid out as a run's (store, logs, tasks with references, rollouts/) with a real
    gateway process (its admin key in its environment, as `harnessrl train` starts it)."""
    run_dir = Path(tempfile.mkdtemp(prefix="harnessrl-isolation-", dir="/tmp"))
    (run_dir / "data").mkdir()
    (run_dir / "data" / "heldout.jsonl").write_text(json.dumps({"reference": SECRET}) + "\n")
    admin_key = "admin-" + secrets.token_hex(12)
    gateway = start_gateway(run_dir / "store.sqlite", engine_url, free_port(), admin_key, run_dir / "logs", 8)
    try:
        gateway.wait_healthy(120)
        protect_run_dir(run_dir)
        yield Run(run_dir, gateway, admin_key, engine_url)
    finally:
        gateway.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def write_script(path: Path, text: str) -> Path:
    """A file any uid can read (the harness may run under one of its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o644)
    return path


@dataclass
class Attack:
    """What one run of the hostile harness did: its ids, result and report, what it was given, and what
    it left behind (files written outside its folder, its task file after the run)."""

    rid: str
    victim: str
    result: AttemptResult
    probe: dict[str, Any]
    task: dict[str, Any]
    written: list[Path]
    task_after: dict[str, Any] | None


async def _start_victim(run: Run, runner: Runner, script: Path) -> tuple[AttemptSpec, asyncio.Task[AttemptResult]]:  # fmt: skip
    """Another rollout's harness, running (it waits two minutes) when this returns."""
    assert PYTHON is not None
    victim, victim_key = run.new_rollout()
    workdir = run.run_dir / "rollouts" / victim / "attempt-0"
    spec = AttemptSpec(victim, 0, victim_key, run.gateway.url, {}, workdir)
    task = asyncio.create_task(runner.run(spec, HarnessSpec([PYTHON, str(script)], timeout_s=120)))
    for _ in range(600):
        if (workdir / "output" / "started").exists() or task.done():
            break
        await asyncio.sleep(0.05)
    if not (workdir / "output" / "started").exists():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise RuntimeError("the other rollout's harness did not start")
    return spec, task


async def _stop_victim(task: asyncio.Task[AttemptResult]) -> None:
    """Cancel the other rollout's attempt, which must still be running."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise RuntimeError("the other rollout's attempt ended before it was cancelled")


async def attack(run: Run, runner: Runner, name: str) -> Attack:
    """Run the victim, then the hostile harness beside it; files it wrote outside its folder are removed
    (a failing run must not leave /etc/harnessrl-escape behind) and listed in `written`."""
    assert PYTHON is not None
    scripts = run.run_dir.parent / f"{run.run_dir.name}-scripts-{name}"
    hostile = write_script(scripts / "hostile.py", HOSTILE)
    victim_py = write_script(scripts / "victim.py", VICTIM)
    scripts.chmod(0o755)
    try:
        victim_spec, victim_task = await _start_victim(run, runner, victim_py)
        try:
            rid, key = run.new_rollout()
            workdir = run.run_dir / "rollouts" / rid / "attempt-0"
            targets = [run.run_dir / "escape.txt", run.run_dir / "rollouts" / "escape.txt", workdir / "escape.txt",
                       workdir / "task.json", victim_spec.workdir / "output" / "escape.txt", Path("/etc/harnessrl-escape")]  # fmt: skip
            task = {"store": str(run.run_dir / "store.sqlite"), "run_dir": str(run.run_dir), "victim": victim_spec.rollout_id,
                    "victim_dir": str(victim_spec.workdir), "secret_file": str(run.run_dir / "data" / "heldout.jsonl"),
                    "write_targets": [str(t) for t in targets], "engine_url": run.engine_url}  # fmt: skip
            spec = AttemptSpec(rid, 0, key, run.gateway.url, task, workdir)
            result = await runner.run(spec, HarnessSpec([PYTHON, str(hostile)], timeout_s=120))
        finally:
            await _stop_victim(victim_task)
    finally:
        shutil.rmtree(scripts, ignore_errors=True)
    written = [t for t in targets[:3] + targets[4:] if t.exists()]
    for t in written:
        t.unlink()
    probe_file = result.output_dir / "probe.json"
    probe = json.loads(probe_file.read_text()) if probe_file.is_file() else {}
    task_file = workdir / "task.json"
    task_after = json.loads(task_file.read_text()) if task_file.is_file() else None
    return Attack(rid, victim_spec.rollout_id, result, probe, task, written, task_after)


def runner_for(kind: str) -> Runner | str:
    """The runner of `kind` (one of KINDS) as the config makes it, with an interpreter the harness's uid
    can run; or why it cannot run here."""
    if PYTHON is None:
        return "no Python interpreter that an unprivileged uid can run"
    if kind == "default":
        runner = make_runner(load_config(None, []).controller)
        if not isinstance(runner, SandboxRunner) and not ROOT:
            return "no bubblewrap here and not root: nothing is enforced (docs/security.md)"
        return runner
    if not ROOT:
        return "a uid of its own for the harness (and forking in the sandbox) needs root"
    if kind == "sandbox-fork":
        runner = make_runner(load_config(None, ["controller.fork_server=true"]).controller)
        if not isinstance(runner, SandboxedForkServerRunner):
            return "no bubblewrap here"
        return SandboxedForkServerRunner(runner.sandbox, python=PYTHON)
    overrides = ["controller.sandbox=false", f"controller.fork_server={kind == 'fork-server'}"]
    runner = make_runner(load_config(None, overrides).controller)
    return ForkServerRunner(python=PYTHON) if isinstance(runner, ForkServerRunner) else runner


def network_isolated(runner: Runner) -> bool:
    """Whether the runner keeps the harness off every port but the gateway's (the sandboxes do; a uid
    of its own does not: docs/security.md)."""
    return isinstance(runner, SandboxRunner | SandboxedForkServerRunner)


def refusals(a: Attack, run: Run, isolated: bool) -> dict[str, bool]:
    """Each probe the harness tried -> whether it was refused, its effect checked where it has one (a
    reward, a state, a file, what is left in `output/` for the grader); `isolated`: the engine's port
    counts (only the sandboxes close it)."""
    p, found = a.probe, set(a.probe.get("found", ()))

    def failed(name: str) -> bool:
        return name in p and not p[name]["ok"]

    out = {name: failed(name) for name in MUST_FAIL}
    out["read key secret"] &= "secret" not in found
    out["scan environs"] &= not found & {"admin", "other_key"}
    no_reward = run.rollout(a.rid)["reward"] is None
    out["write own reward"] &= no_reward
    out["self reward"] &= no_reward
    out["cancel other rollout"] &= run.rollout(a.victim)["rollout"]["state"] != "cancelled"
    for target in a.task["write_targets"]:
        kept = a.task_after == a.task if target.endswith("/task.json") else Path(target) not in a.written
        out[f"write {target}"] = failed(f"write {target}") and kept
    listing = p.get("list run dir", {"ok": True, "value": None})
    out["list run dir"] = not listing["ok"] or listing["value"] == ["rollouts"]  # the sandbox's stand-in
    left = {q.name for q in a.result.output_dir.iterdir()} if a.result.output_dir.is_dir() else set()
    out["plant symlink"] = "plant symlink" in p and "answer.json" not in left  # made, then removed
    out["plant fifo"] = "plant fifo" in p and "fifo.json" not in left
    if isolated:
        out["engine port"] = failed("engine port")
    return out


def own_model_call_ok(a: Attack) -> bool:
    """Whether the harness's own model call (with its own key) got a 200."""
    return a.probe.get("own model call") == {"ok": True, "value": 200}
