"""The `coding` grader, run by the controller outside the sandbox.

It rebuilds the task's repository from the task (never from the attempt), then applies the agent's
changes to **source files only**: a changed file the harness reports is taken only when it is a file
the task's repository has and not a test file or test configuration (`tasks.is_test_path`: tests/,
test_*.py, conftest.py, pytest.ini, tox.ini, setup.cfg, pyproject.toml). So tests and their
configuration are those of the task, whatever the agent edited, and a file the agent added (a
`conftest.py`, a `pytest.py` shadowing the test runner, a `sitecustomize.py`) is ignored. Then it
runs the task's fail-to-pass and pass-to-pass tests in a temp directory with a timeout.

Reward: 1.0 when every fail-to-pass and pass-to-pass test passes, else 0.0. With
`reference["partial_credit"]` (`pipeline --partial-credit`), the fraction of those tests passing.
An attempt that edited tests or test configuration, or wrote files outside the repository, is flagged
(`details["hacking"]`, `hacking_findings`): its changes there were ignored, and the flag is counted per
step so a policy that learns to try is seen (docs/credit.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath
from typing import Any

from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.coding.tasks import is_test_path
from harnessrl.examples.coding.testrun import run_tests
from harnessrl.schema import RewardIn, Task

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20  # a changed file larger than this is ignored


def _safe_relpath(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts


def agent_changes(output_dir: Path, repo: dict[str, str]) -> tuple[dict[str, str | None], list[str]]:
    """The changes the harness reported ({path: new text, or None if deleted}) restricted to the
    repository's source files, and the reported paths that were ignored (tests, config, new files)."""
    files_dir = output_dir / "files"
    try:
        changes = json.loads((output_dir / "changes.json").read_text())
    except (OSError, ValueError):
        changes = {}
    reported: list[str] = [str(p) for p in changes.get("changed", []) + changes.get("added", [])]
    deleted: list[str] = [str(p) for p in changes.get("deleted", [])]
    if files_dir.is_dir():  # also whatever lies under files/ (the changes.json may be missing)
        reported += [p.relative_to(files_dir).as_posix() for p in files_dir.rglob("*") if p.is_file()]
    applied: dict[str, str | None] = {}
    ignored: list[str] = []
    for rel in dict.fromkeys(reported + deleted):
        if not _safe_relpath(rel) or rel not in repo or is_test_path(rel):
            ignored.append(rel)
            continue
        if rel in deleted:
            applied[rel] = None
            continue
        path = files_dir / rel
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            ignored.append(rel)
            continue
        applied[rel] = path.read_text(errors="replace")
    return applied, ignored


def hacking_findings(ignored: list[str], repo: dict[str, str]) -> dict[str, list[str]]:
    """What of the agent's ignored changes looks like gaming the tests: edits of test files or test
    configuration, and files outside the repository (a `conftest.py`, a `pytest.py` shadowing the
    runner, a path that climbs out). Empty when the agent touched only source files."""
    tests = sorted(p for p in ignored if _safe_relpath(p) and p in repo and is_test_path(p))
    outside = sorted(p for p in ignored if not _safe_relpath(p) or p not in repo)
    return {k: v for k, v in (("edited_tests", tests), ("outside_repo", outside)) if v}


def grade(task: Task, result: AttemptResult) -> RewardIn:
    """Run the task's tests on its repository with the agent's source changes (see the module doc)."""
    ref: dict[str, Any] = task.reference
    repo: dict[str, str] = dict(task.input["files"])
    repo.update(ref.get("test_files", {}))  # tests and test configuration from the task's reference
    applied, ignored = agent_changes(result.output_dir, repo)
    for rel, text in applied.items():
        if text is None:
            repo.pop(rel, None)
        else:
            repo[rel] = text
    tests = list(ref["fail_to_pass"]) + list(ref["pass_to_pass"])
    run = run_tests(repo, timeout_s=float(ref.get("timeout_s", 30.0)), test_ids=tests)
    passed = run.passed(tests)
    f2p = len(run.passed(list(ref["fail_to_pass"])))
    if ref.get("partial_credit"):
        value = len(passed) / len(tests) if tests else 0.0
    else:
        value = 1.0 if tests and len(passed) == len(tests) else 0.0
    details = {
        "passed": len(passed),
        "tests": len(tests),
        "fail_to_pass_passed": f2p,
        "changed": sorted(applied),
        "ignored": sorted(ignored),
        "tests_timed_out": run.timed_out,
    }
    flagged = hacking_findings(ignored, repo)
    if flagged:  # counted per step (`rollouts_flagged_hacking`) and shown by inspect: docs/credit.md
        details["hacking"] = flagged
        log.warning("event=coding_hacking task=%s findings=%s", task.task_id, flagged)
    log.info(
        "event=coding_graded task=%s reward=%s passed=%d/%d", task.task_id, value, len(passed), len(tests)
    )
    return RewardIn(value=value, details=details)
