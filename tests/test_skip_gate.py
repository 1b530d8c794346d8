"""The skip gate (tests/support/skips.py) in a real pytest run: a skip for a missing package fails the
run and is named with its reason; a skip `MAY_SKIP` allows (no vLLM: the machine lacks a GPU's
engine) keeps it green and is printed with what the machine lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pytest(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # Only the gate's plugin: the installed ones (schemathesis, hypothesis, …) took most of each run's time.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}  # a run of its own
    env |= {"PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.support.skips", "-p", "no:cacheprovider",
            "--import-mode=importlib", "-c", os.devnull, "--rootdir", str(root), *extra, str(root / "tests")]  # fmt: skip
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_for_a_missing_package_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "tests" / "services").mkdir(parents=True)
    vllm = "import pytest\ndef test_served():\n    pytest.skip('no vLLM venv (.bench/venv-vllm)')\n"
    (tmp_path / "tests" / "services" / "test_vllm_real.py").write_text(vllm)
    allowed = _pytest(tmp_path)
    assert allowed.returncode == 0, allowed.stdout
    assert "skipped, and why" in allowed.stdout and "allowed: this machine lacks vLLM" in allowed.stdout

    probe = "import pytest\ndef test_lora():\n    pytest.importorskip('harnessrl_no_such_peft')\n"
    (tmp_path / "tests" / "test_lora_probe.py").write_text(probe)
    failed = _pytest(tmp_path)
    assert failed.returncode == 1, failed.stdout
    named = [
        line
        for line in failed.stdout.splitlines()
        if line.startswith("  tests/test_lora_probe.py::test_lora")
    ]
    assert named and "could not import 'harnessrl_no_such_peft'" in named[0], failed.stdout

    # `make test` runs the suite on pytest-xdist workers: the skip is reported by a worker, and the
    # gate in the process that started them still fails the run and names it
    workers = _pytest(tmp_path, "-p", "xdist.plugin", "-n", "2")
    assert workers.returncode == 1, workers.stdout
    assert f"  {named[0].strip()}" in workers.stdout.splitlines(), workers.stdout
