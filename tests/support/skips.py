"""Tests that cannot pass by skipping: the one list of skips a run may have, and the gate that fails it
on any other (a pytest plugin, loaded by tests/conftest.py).

A test may skip only where this machine lacks what installing the project cannot give it: hardware, a
cluster, a service, the kernel's or the user's privileges. Each such skip is named below (`MAY_SKIP`:
the tests, the reason their skip gives, what the machine lacks). Any other skip — a missing tokenizer,
`peft`, `transformers`, a package of the extras — makes the run fail, naming the tests and why, so a
check `make test` is meant to run is never green because it did not run. The run prints every skip
(allowed or not) and its reason at the end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

# (test id prefix, pattern of the skip's reason, what this machine lacks)
MAY_SKIP: tuple[tuple[str, str, str], ...] = (
    ("tests/services/test_vllm_real.py", r"vLLM venv", "vLLM serving (a GPU's engine: make install-vllm)"),
    (
        "tests/chat/test_vllm_render.py",
        r"vLLM venv",
        "vLLM's own venv (make install-vllm), for the live re-render",
    ),
    ("tests/controller/test_kubernetes.py", r"KUBECONFIG", "a Kubernetes cluster"),
    ("tests/", r"no PostgreSQL server", "a PostgreSQL server that can start here"),
    (
        "tests/",
        r"kernel refuses namespaces|no sandbox here|no bubblewrap here|bubblewrap cannot run here|the pod is run with bubblewrap",
        "namespaces for bubblewrap (the kernel's setting)",
    ),
    ("tests/controller/", r"needs root|as root|forks as root only|as another user", "root"),
    (
        "tests/controller/test_isolation.py",
        r"no Python interpreter that an unprivileged uid can run",
        "a Python that another user may run (not under a 0700 home)",
    ),
    ("tests/controller/test_sandbox.py", r"no memory\+pids cgroup", "cgroups the controller may create"),
    ("tests/", r"oneDNN", "oneDNN in this torch build (the CPU's kernels)"),
    ("tests/preload/test_preload_openai.py", r"/proc/self/smaps_rollup", "Linux's /proc"),
)


@dataclass(frozen=True)
class Skip:
    """One skipped test (or module, skipped while collected) and its reason."""

    nodeid: str
    reason: str

    def allowed(self) -> str | None:
        """What the machine lacks, when `MAY_SKIP` lets this test skip; None when it may not."""
        for prefix, pattern, why in MAY_SKIP:
            if self.nodeid.startswith(prefix) and re.search(pattern, self.reason):
                return why
        return None


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class SkipGate:
    """Collects the run's skips; fails the run on one `MAY_SKIP` does not allow; prints them all."""

    def __init__(self) -> None:
        self.skips: list[Skip] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.skips.append(Skip(report.nodeid, _reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(Skip(report.nodeid, _reason(report)))

    def forbidden(self) -> list[Skip]:
        """The skips no entry of `MAY_SKIP` allows."""
        return [s for s in self.skips if s.allowed() is None]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.forbidden() and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.skips:
            return
        tr = terminalreporter
        tr.section("skipped, and why")
        for s in self.skips:
            why = s.allowed()
            tr.line(f"{s.nodeid}: {s.reason}" + (f"  [allowed: this machine lacks {why}]" if why else ""))
        if bad := self.forbidden():
            tr.line("")
            tr.line(f"FAILED: {len(bad)} test(s) skipped for what installing gives (make install), not for "
                    "hardware, a cluster or a service this machine lacks (tests/support/skips.py MAY_SKIP):",
                    red=True)  # fmt: skip
            for s in bad:
                tr.line(f"  {s.nodeid}: {s.reason}", red=True)


def pytest_configure(config: pytest.Config) -> None:
    """Register the gate once per run."""
    if not config.pluginmanager.has_plugin("harnessrl-skip-gate"):
        config.pluginmanager.register(SkipGate(), "harnessrl-skip-gate")
