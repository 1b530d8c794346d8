"""The harness contract's places are the same in every runner (docs/your-harness.md, "Where an attempt
runs"): the working directory and `HOME` are the attempt's `home/`, `harness.files` are copied there,
`HARNESSRL_OUTPUT` is the attempt's `output/`. Each runner runs a real harness that is itself one of
the `harness.files` (started by its relative name), reads another by relative name, a folder's file,
writes in its working directory and its answer into `HARNESSRL_OUTPUT`. Ray runs the node side of its
task (`run_on_node`, what a Ray worker runs); Kubernetes runs the Job the runner builds (its command,
environment and volumes) in a bubblewrap "pod" with the Secret's files mounted where the Job mounts them.
"""

from __future__ import annotations

import base64
import json
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
from harnessrl.controller.isolation import unreachable
from harnessrl.controller.runner import AttemptSpec, copy_files, pack_home
from harnessrl.controller.runners import kubernetes_jobs as kj
from harnessrl.controller.runners.ray_runner import RaySpec, run_on_node
from harnessrl.controller.runners.sandbox import SandboxSpec, bwrap_problem, find_bwrap, view_paths

ROOT = os.geteuid() == 0
# An interpreter an unprivileged uid can run (this one, unless it lives under a 0700 directory).
PYTHON = next((p for p in (sys.executable, "/usr/bin/python3") if os.path.exists(p) and unreachable(p, os.X_OK) is None), sys.executable)  # fmt: skip
NO_SANDBOX = bwrap_problem()

HARNESS = r"""
import json, os, pathlib
data = open("data.txt").read()                     # a harness.files file, by its relative name
setting = json.load(open("conf/settings.json"))    # a file of a harness.files folder
pathlib.Path("scratch.txt").write_text("the working directory is writable")
out = pathlib.Path(os.environ["HARNESSRL_OUTPUT"])
(out / "answer.txt").write_text(data.strip().upper() + " " + str(setting["n"]))
(out / "where.json").write_text(json.dumps({
    "cwd": os.getcwd(), "home": os.environ["HOME"], "output": str(out),
    "task": json.load(open(os.environ["HARNESSRL_TASK"])), "uid": os.getuid(),
    "scratch": os.path.abspath("scratch.txt"), "exec": os.access("tool.sh", os.X_OK)}))
"""


@pytest.fixture
def project() -> Iterator[Path]:
    """A project folder with the harness and its files, and room for a run, that other users can
    search (an attempt's own uid must reach it; pytest's temporary folders are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="harnessrl-files-", dir="/tmp"))
    path.chmod(0o711)
    (path / "harness.py").write_text(HARNESS)
    (path / "data.txt").write_text("forty two\n")
    (path / "conf").mkdir()
    (path / "conf" / "settings.json").write_text('{"n": 42}')
    (path / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (path / "tool.sh").chmod(0o755)  # an executable file keeps its mode wherever the attempt runs
    for p in (path / "data.txt", path / "conf" / "settings.json"):
        p.chmod(0o600)  # the attempt's uid gets its copies, not the owner's mode bits in its way
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _attempt(project: Path) -> tuple[AttemptSpec, HarnessSpec]:
    """One attempt's spec, with `harness.files` copied as the controller copies them."""
    workdir = project / "run" / "rollouts" / "ro1" / "attempt-0"
    spec = AttemptSpec("ro1", 0, "key-1", "http://127.0.0.1:9", {"question": "q?"}, workdir)
    files = tuple(project / n for n in ("harness.py", "data.txt", "conf", "tool.sh"))
    harness = HarnessSpec(command=[PYTHON, "harness.py"], timeout_s=60, files=files)
    copy_files(files, workdir)
    return spec, harness


def _check(where: dict[str, Any], output: Path) -> None:
    """The places the contract names, as the harness saw them, and its answer in `output/`."""
    assert (output / "answer.txt").read_text() == "FORTY TWO 42"
    cwd = Path(where["cwd"])
    assert cwd.name == "home" and where["home"] == where["cwd"], where
    assert Path(where["output"]) == cwd.parent / "output", where
    assert where["scratch"] == str(cwd / "scratch.txt") and where["task"] == {"question": "q?"}
    assert where["exec"] is True


RUNNERS = {
    "plain": lambda: LocalRunner(own_uid="never"),
    "own-uid": lambda: LocalRunner(own_uid="required"),
    "fork-server": lambda: ForkServerRunner(python=PYTHON, own_uid="never"),
    "fork-server-own-uid": lambda: ForkServerRunner(python=PYTHON, own_uid="required"),
    "sandbox": lambda: SandboxRunner(SandboxSpec(cgroup="never")),
    "sandbox-fork": lambda: SandboxedForkServerRunner(SandboxSpec(cgroup="never"), python=PYTHON),
}


@pytest.mark.parametrize("kind", list(RUNNERS))
async def test_a_harness_finds_its_files_and_writes_its_output(project: Path, kind: str) -> None:
    if "own-uid" in kind and not ROOT:
        pytest.skip("a uid of its own needs root")
    if kind.startswith("sandbox") and NO_SANDBOX:
        pytest.skip(f"no sandbox here: {NO_SANDBOX}")
    runner: Runner = RUNNERS[kind]()
    spec, harness = _attempt(project)
    await runner.start()
    try:
        result = await runner.run(spec, harness)
    finally:
        runner.close()
    assert result.infra_error is None and result.exit_code == 0, result
    if isinstance(runner, SandboxedForkServerRunner):
        assert runner.starts == 1  # forked, not run by the exec sandbox
    where = json.loads((result.output_dir / "where.json").read_text())
    _check(where, result.output_dir)
    assert where["cwd"] == str(spec.workdir / "home")
    if "own-uid" in kind or (kind.startswith("sandbox") and ROOT):
        assert where["uid"] != 0  # and it could still read the 0600 files copied for it


@pytest.mark.parametrize("sandboxed", [False, True])
def test_ray_node_side_gets_the_files(project: Path, sandboxed: bool) -> None:
    if sandboxed and NO_SANDBOX:
        pytest.skip(f"no sandbox here: {NO_SANDBOX}")
    spec, harness = _attempt(project)
    node_base = project / "node"
    ray_spec = RaySpec(
        node_workdir=str(node_base), sandbox=SandboxSpec(cgroup="never") if sandboxed else None
    )
    node = run_on_node(spec, harness, ray_spec, "node-1", pack_home(spec.workdir))
    assert node.infra_error is None and node.exit_code == 0, node
    out = project / "out"
    out.mkdir()
    for rel, data in node.files.items():
        (out / rel).write_bytes(data)
    where = json.loads(node.files["where.json"])
    _check(where, out)
    assert where["cwd"].startswith(str(node_base))  # ran on the node's own folder, not the controller's


def _pod_command(job: dict[str, Any], secret: dict[str, Any], pod: Path) -> tuple[list[str], dict[str, str]]:
    """What a kubelet would run for the Job's harness container: its command in a filesystem of the
    system, the interpreter, the Secret's files at the input mount and an empty work volume."""
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    (pod / "input").mkdir(parents=True)
    (pod / "work").mkdir()
    volume = next(v for v in spec["volumes"] if v["name"] == "harnessrl-input")
    for item in volume["secret"]["items"]:
        (pod / "input" / item["path"]).write_bytes(data[item["key"]])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}  # the image's
    for e in container["env"]:
        env[e["name"]] = e["value"] if "value" in e else data[e["valueFrom"]["secretKeyRef"]["key"]].decode()
    bwrap = [str(find_bwrap()), "--die-with-parent", "--unshare-pid", "--proc", "/proc", "--dev", "/dev"]
    bwrap += [] if ROOT else ["--unshare-user"]
    for p in dict.fromkeys(view_paths(SandboxSpec())):
        link = os.path.islink(p) and os.path.dirname(p) == "/"
        bwrap += ["--symlink", os.readlink(p), p] if link else ["--ro-bind-try", p, p]
    bwrap += ["--tmpfs", "/tmp", "--ro-bind", str(pod / "input"), kj.INPUT_DIR]
    bwrap += ["--bind", str(pod / "work"), kj.WORK_DIR, "--chdir", "/"]
    return [*bwrap, *container["command"]], env


@pytest.mark.skipif(bool(NO_SANDBOX), reason=f"the pod is run with bubblewrap: {NO_SANDBOX}")
def test_kubernetes_job_gets_the_files(project: Path) -> None:
    spec, harness = _attempt(project)
    settings = kj.JobSettings(namespace="ns", run="run1")
    template = {"spec": {"containers": [{"name": "harness", "image": "python:3.11-slim"}]}}
    home = pack_home(spec.workdir)
    name = kj.job_name("run1", spec.rollout_id, spec.attempt)
    job = kj.build_job(settings, template, spec, harness, name, with_home=bool(home))
    secret = kj.build_secret(settings, spec, name, home)
    argv, env = _pod_command(job, secret, project / "pod")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _, archive = kj.split_log(proc.stdout)
    assert archive is not None
    out = project / "out"
    kj.unpack_output(archive, out, 1 << 20)
    where = json.loads((out / "where.json").read_text())
    _check(where, out)
    assert where["cwd"] == f"{kj.WORK_DIR}/home"


def test_harness_files_too_big_for_a_secret_are_refused_by_name(project: Path) -> None:
    spec, _ = _attempt(project)
    settings = kj.JobSettings(namespace="ns", run="run1")
    with pytest.raises(ValueError, match=r"harness\.files pack to \d+ bytes"):
        kj.build_secret(settings, spec, "job", os.urandom(kj.MAX_HOME_BYTES + 1))


def test_no_files_no_archive(tmp_path: Path) -> None:
    assert pack_home(tmp_path / "attempt-0") == b""
