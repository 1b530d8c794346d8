"""Running a task repository's tests: a temp copy, `python -m pytest` in a subprocess with a
timeout, per-test outcomes read from a JUnit XML report. Used by validation and by the grader."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Only what pytest needs: the controller's secrets and the agent's environment never reach the tests.
_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclass(frozen=True)
class TestRun:
    """The outcome of one pytest run: per-test pass/fail (test id -> passed) and why it ended."""

    __test__ = False  # not a pytest test class

    outcomes: dict[str, bool]
    returncode: int | None  # None: killed at the timeout
    output: str

    @property
    def timed_out(self) -> bool:
        """Whether the run was killed at its time limit."""
        return self.returncode is None

    def passed(self, test_ids: list[str]) -> list[str]:
        """The tests of `test_ids` that ran and passed."""
        return [t for t in test_ids if self.outcomes.get(t, False)]


def write_repo(root: Path, files: dict[str, str]) -> None:
    """Write a repository given as {relative path: text} under `root`."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _junit_outcomes(report: Path) -> dict[str, bool]:
    """{"tests/test_x.py::test_name": passed} from pytest's JUnit XML report."""
    outcomes: dict[str, bool] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        path = classname.replace(".", "/") + ".py"  # "tests.test_x" -> tests/test_x.py
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        outcomes[f"{path}::{name}"] = not failed
    return outcomes


def run_tests(files: dict[str, str], timeout_s: float = 30.0, test_ids: list[str] | None = None) -> TestRun:
    """Run the repository's tests (all, or `test_ids`) in a fresh temp copy; never raises for the
    tests' own failures, crashes or hangs (a hang is killed with its process group)."""
    with tempfile.TemporaryDirectory(prefix="hrl-coding-") as tmp:
        root = Path(tmp) / "repo"
        write_repo(root, files)
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        cmd += ["-o", "junit_family=xunit1", *(test_ids or [])]
        env = {k: os.environ[k] for k in _ENV_KEEP if k in os.environ}
        # no third-party pytest plugins: 10x faster start, and nothing of the host decides outcomes
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            code = None
        text = out.decode("utf-8", errors="replace")[-4000:]
        try:
            outcomes = _junit_outcomes(report) if report.exists() else {}
        except ET.ParseError:
            outcomes = {}
        if code is None:
            log.info("event=tests_timeout timeout_s=%s", timeout_s)
        return TestRun(outcomes, code, text)
