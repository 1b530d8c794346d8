"""A harness in a virtualenv of its own, outside harnessrl's, under the default sandbox: the sandbox
does not show that venv, so the run is refused before it starts with the path and the setting that
exposes it (`controller.sandbox_ro_paths`); with that setting the same harness runs in the sandbox.
Real venv (made by the system's Python), real bubblewrap."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.config import ControllerSection
from harnessrl.controller import HarnessSpec, SandboxRunner
from harnessrl.controller.factory import make_runner, sandbox_spec
from harnessrl.controller.runner import AttemptSpec
from harnessrl.controller.runners.sandbox import bwrap_problem
from harnessrl.controller.runners.sandbox_view import unseen_by_sandbox
from harnessrl.errors import ConfigError

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
pytestmark = [
    pytest.mark.skipif(bwrap_problem() is not None, reason=f"no sandbox here: {bwrap_problem()}"),
    pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 to make a venv with"),
]

HARNESS = """
import json, os, sys
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "prefix.json"), "w").write(json.dumps(sys.prefix))
"""


@pytest.fixture(scope="module")
def venv() -> Iterator[Path]:
    """A virtualenv of its own with a console script, where a user's harness could live."""
    base = Path(tempfile.mkdtemp(prefix="harnessrl-venv-", dir="/tmp"))
    base.chmod(0o755)
    env = base / "agent-venv"
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    script = env / "bin" / "my-agent"
    script.write_text(f"#!{env}/bin/python\n{HARNESS}")
    script.chmod(0o755)
    (base / "harness.py").write_text(HARNESS)
    yield env
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("form", ["interpreter", "console-script"])
def test_a_venv_the_sandbox_does_not_show_is_refused_before_the_run(venv: Path, form: str) -> None:
    command = [str(venv / "bin" / "python"), str(venv.parent / "harness.py")]
    if form == "console-script":
        command = [str(venv / "bin" / "my-agent")]
    with pytest.raises(ConfigError) as e:
        make_runner(ControllerSection(sandbox=True), HarnessSpec(command))
    assert str(venv) in str(e.value) and "controller.sandbox_ro_paths" in str(e.value)
    assert isinstance(make_runner(ControllerSection(sandbox=True, sandbox_ro_paths=[str(venv)]), HarnessSpec(command)), SandboxRunner)  # fmt: skip
    assert not isinstance(make_runner(ControllerSection(sandbox=False), HarnessSpec(command)), SandboxRunner)


async def test_the_check_is_right_both_ways(venv: Path, tmp_path: Path) -> None:
    """Without the path the harness really fails in the sandbox; with it, it runs in its own venv."""
    command = [str(venv / "bin" / "my-agent")]
    results = {}
    for ro in ([], [str(venv)]):
        section = ControllerSection(sandbox=True, sandbox_ro_paths=ro, sandbox_cgroup="never")
        spec = sandbox_spec(section)
        workdir = Path(tempfile.mkdtemp(prefix="harnessrl-view-", dir="/tmp")) / "attempt-0"
        attempt = AttemptSpec("ro1", 0, "k", "http://127.0.0.1:9", {}, workdir)
        result = await SandboxRunner(spec).run(attempt, HarnessSpec(command, timeout_s=60))
        prefix = result.output_dir / "prefix.json"
        results[bool(ro)] = (unseen_by_sandbox(command, None, spec), result.exit_code, prefix.exists() and json.loads(prefix.read_text()))  # fmt: skip
        shutil.rmtree(workdir.parent, ignore_errors=True)
    refused, code, _ = results[False]
    assert refused is not None and code != 0  # what the refusal spares the user: a failure per attempt
    assert results[True] == (None, 0, str(venv))
