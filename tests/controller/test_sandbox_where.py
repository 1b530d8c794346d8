"""Every sandboxed runner works wherever the harness, a module it imports, its interpreter's prefix (a
virtualenv of its own) and the run directory are: under `/tmp` (which each attempt gets fresh and
empty), in a folder whose name has a space and non-ASCII letters, reached through a symlinked folder,
with no setting (`sandbox_view.attempt_view` shows the harness's folder and its interpreter). The
harness imports the module beside it as `python harness.py` does by hand; the run's folder inside the
project (its store) stays hidden. Real venv, real bubblewrap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.config import ControllerSection, load_config
from harnessrl.controller.factory import make_runner
from harnessrl.controller.runner import AttemptSpec, HarnessSpec
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner
from harnessrl.services import free_port
from tests.controller.test_sandbox import _REFUSED

pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")

HARNESS = """
import json, os, sys
import helpers
stores = json.load(open(os.environ["HARNESSRL_TASK"]))["stores"]
json.dump({"prefix": sys.prefix, "helper": helpers.__file__, "answer": helpers.answer(),
           "preloaded": "xml.dom.minidom" in sys.modules, "stores seen": [s for s in stores if os.path.exists(s)]},
          open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "where.json"), "w"))
"""


@pytest.fixture(scope="module")
def project() -> Iterator[Path]:
    """A project under /tmp, named with a space and non-ASCII letters, reached through a link:
    `harness.py`, `helpers.py` beside it and `venv/` (made from this interpreter, stdlib only)."""
    real = Path(tempfile.mkdtemp(prefix="hrl où ", dir="/tmp"))
    os.chmod(real, 0o755)  # as a clone's folder would be (mkdtemp makes it 0700)
    link = real.with_name(real.name + " link")
    link.symlink_to(real)
    try:
        proj = link / "proj ü"
        proj.mkdir()
        (proj / "harness.py").write_text(HARNESS)
        (proj / "helpers.py").write_text("def answer():\n    return 42\n")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(proj / "venv")], check=True)
        agent = proj / "venv" / "bin" / "my-agent"  # a console script as pip writes it for this path
        python = proj / "venv" / "bin" / "python"
        agent.write_text(f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n{HARNESS}")
        site = next((proj / "venv" / "lib").glob("python3*/site-packages"))
        shutil.copy(proj / "helpers.py", site / "helpers.py")  # its module installed in its venv
        agent.chmod(0o755)
        (proj / "runs").mkdir()
        (proj / "runs" / "store.sqlite").write_text("the key secret")
        yield proj
    finally:
        link.unlink()
        shutil.rmtree(real, ignore_errors=True)


def test_a_relative_venv_python_in_the_config_stays_the_venvs(project: Path) -> None:
    """`harness.command: [venv/bin/python, harness.py]`: the venv's python is a link to its base
    interpreter; the config keeps the link (followed, the harness would run outside its venv)."""
    (project / "config.yaml").write_text("harness:\n  command: [venv/bin/python, harness.py]\n")
    cfg = load_config(project / "config.yaml")
    real = Path(os.path.realpath(project))  # (the config's folder is taken at its real path)
    assert cfg.harness.command == [str(real / "venv" / "bin" / "python"), str(real / "harness.py")]


@pytest.mark.parametrize("kind", ["exec", "fork", "console-script"])
async def test_a_project_under_tmp_runs_in_every_sandboxed_runner(project: Path, kind: str) -> None:
    python = str(project / "venv" / "bin" / "python")
    command = [python, str(project / "harness.py")]
    if kind == "console-script":
        command = [str(project / "venv" / "bin" / "my-agent")]
    section = ControllerSection(sandbox=True, fork_server=kind == "fork", preload=["xml.dom.minidom"])
    runner = make_runner(section, HarnessSpec(command))  # nothing to add to sandbox_ro_paths
    if isinstance(runner, SandboxedForkServerRunner):
        runner.python = python  # the fork server of the harness's interpreter
    workdir = project / "runs" / "rollouts" / f"r-{kind}" / "attempt-0"
    stores = [str(project / "runs" / "store.sqlite"), os.path.realpath(project / "runs" / "store.sqlite")]
    gateway = f"http://127.0.0.1:{free_port()}/"  # (a port under 1024 is root's alone in the sandbox)
    spec = AttemptSpec(f"r-{kind}", 0, "k", gateway, {"stores": stores}, workdir)
    try:
        result = await runner.run(spec, HarnessSpec(command, timeout_s=60))
    finally:
        runner.close()
    assert result.infra_error is None and result.exit_code == 0, (result.infra_error, result.stderr_tail)
    where = json.loads((result.output_dir / "where.json").read_text())
    assert where["prefix"] == str(project / "venv") and where["answer"] == 42
    helper = next((project / "venv" / "lib").glob("python3*/site-packages/helpers.py"))
    assert where["helper"] == str(helper if kind == "console-script" else project / "helpers.py")
    assert stores[0] != stores[1] and where["stores seen"] == []  # the run's folder is covered
    assert isinstance(runner, SandboxedForkServerRunner) == (kind == "fork")
    if isinstance(runner, SandboxedForkServerRunner) and os.geteuid() == 0:  # (else: the exec sandbox)
        assert where["preloaded"] and runner.starts == 1
