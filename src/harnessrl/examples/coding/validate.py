"""Validation of built tasks: the tests fail with the bug, pass with the fix, and say the same
thing every time (`runs` runs of each); fail-to-pass and pass-to-pass tests are read off the runs."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harnessrl.examples.coding.tasks import Candidate
from harnessrl.examples.coding.testrun import TestRun, run_tests

log = logging.getLogger(__name__)

# Reasons a candidate is broken (the pipeline's statistics count each).
FAILS_TO_FAIL = "fails_to_fail"  # the bug changes no test outcome (an equivalent mutant)
FAILS_TO_PASS = "fails_to_pass"  # the fixed repository does not pass its own tests
FLAKY = "flaky"  # two runs of the same code disagree
TIMEOUT = "timeout"  # a run hit its time limit (e.g. the mutant loops forever)


@dataclass
class Validation:
    """A candidate's verdict: broken (with a reason) or valid with its fail/pass-to-pass tests."""

    task_id: str
    reason: str | None  # None: valid
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def valid(self) -> bool:
        """Whether the task passed validation."""
        return self.reason is None


def _same(runs: list[TestRun]) -> bool:
    return all(r.outcomes == runs[0].outcomes and r.returncode == runs[0].returncode for r in runs)


def validate(candidate: Candidate, runs: int = 3, timeout_s: float = 10.0) -> Validation:
    """Run the buggy and the fixed repository `runs` times each and judge the candidate."""
    buggy_files = candidate.files
    fixed_files = {**candidate.files, candidate.module_path: candidate.fixed_module}
    ids = candidate.test_ids
    buggy: list[TestRun] = []
    fixed: list[TestRun] = []
    for i in range(runs):  # stop early on the first run that decides
        buggy.append(run_tests(buggy_files, timeout_s))
        if buggy[-1].timed_out:
            return Validation(candidate.task_id, TIMEOUT, detail="buggy repository timed out")
        if i == 0 and len(buggy[0].passed(ids)) == len(ids):
            return Validation(candidate.task_id, FAILS_TO_FAIL, detail="all tests pass with the bug")
        fixed.append(run_tests(fixed_files, timeout_s))
        if fixed[-1].timed_out:
            return Validation(candidate.task_id, TIMEOUT, detail="fixed repository timed out")
        if len(fixed[-1].passed(ids)) != len(ids):
            why = FAILS_TO_PASS if i == 0 else FLAKY
            return Validation(candidate.task_id, why, detail=fixed[-1].output[-1000:])
    if not (_same(buggy) and _same(fixed)):
        return Validation(candidate.task_id, FLAKY, detail="outcomes differ between runs")
    failing = [t for t in ids if not buggy[0].outcomes.get(t, False)]
    passing = [t for t in ids if buggy[0].outcomes.get(t, False)]
    return Validation(candidate.task_id, None, fail_to_pass=failing, pass_to_pass=passing)


def validate_all(
    candidates: list[Candidate], runs: int = 3, timeout_s: float = 10.0, workers: int = 2
) -> list[Validation]:
    """Validate candidates with `workers` concurrent pytest processes; results in input order."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda c: validate(c, runs, timeout_s), candidates))
    for r in results:
        log.info("event=task_validated task=%s valid=%s reason=%s", r.task_id, r.valid, r.reason)
    return results
