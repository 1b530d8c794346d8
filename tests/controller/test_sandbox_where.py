"""Every sandboxed runner works wherever the harness, a module it imports, its interpreter's prefix (a
virtualenv) and the run directory are: under `/tmp` (which each attempt gets fresh and empty), in a
folder whose name has a space and non-ASCII letters, reached through a symlinked folder. The harness
imports the module beside it as `python harness.py` does by hand."""

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

from harnessrl.controller.runner import AttemptSpec, HarnessSpec, Runner
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner
from tests.controller.test_sandbox import _REFUSED

pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")

HARNESS = """
import json, os, sys
import helpers
json.dump({"prefix": sys.prefix, "helper": helpers.__file__, "answer": helpers.answer(),
           "preloaded": "xml.dom.minidom" in sys.modules, "uid": os.getuid()},
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
        yield proj
    finally:
        link.unlink()
        shutil.rmtree(real, ignore_errors=True)


def _runners(sandbox: SandboxSpec, python: str) -> list[tuple[str, Runner]]:
    return [
        ("exec", SandboxRunner(sandbox)),
        ("fork", SandboxedForkServerRunner(sandbox, ["xml.dom.minidom"], python=python)),
    ]


@pytest.mark.parametrize("kind", ["exec", "fork"])
async def test_a_project_under_tmp_runs_in_every_sandboxed_runner(project: Path, kind: str) -> None:
    python = str(project / "venv" / "bin" / "python")
    sandbox = SandboxSpec(ro_paths=(str(project),))
    runner = dict(_runners(sandbox, python))[kind]
    harness = HarnessSpec([python, str(project / "harness.py")], timeout_s=60)
    workdir = project / "runs" / "rollouts" / f"r-{kind}" / "attempt-0"
    try:
        result = await runner.run(
            AttemptSpec(f"r-{kind}", 0, "k", "http://127.0.0.1:9/", {}, workdir), harness
        )
    finally:
        runner.close()
    assert result.infra_error is None and result.exit_code == 0, (result.infra_error, result.stderr_tail)
    where = json.loads((result.output_dir / "where.json").read_text())
    assert where["prefix"] == str(project / "venv") and where["answer"] == 42
    assert where["helper"] == str(project / "helpers.py")
    if kind == "fork" and os.geteuid() == 0:  # (not root: the fork server runs it in the exec sandbox)
        assert where["preloaded"] and isinstance(runner, SandboxedForkServerRunner) and runner.starts == 1
