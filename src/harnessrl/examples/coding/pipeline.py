"""The coding data pipeline: build → validate → filter → (probe) → JSONL + statistics.

    python -m harnessrl.examples.coding.pipeline --out data/coding.jsonl [--max-tasks N] [--probe-k K]

1. build: mutants of HumanEval's canonical solutions as tiny repositories (`tasks.py`);
2. filter before running anything: an empty statement, no test, or more than `--max-tests` tests;
3. validate: the tests fail with the bug, pass with the fix, 3 runs agree (`validate.py`);
4. probe (`--probe-k K`, off by default): the current model tries each task K times through the real
   harness and gateway (`probe.py`); tasks it always solves are dropped, tasks with mixed outcomes
   kept, and of the never-solved ones only a `--never-solved-share` (chosen by a stable hash) kept.
It writes the kept tasks as JSONL (one `harnessrl.schema.Task` a line), the statistics as JSON next
to it (`<out>.stats.json`: built, dropped per reason, validated, kept), and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harnessrl.examples.coding.tasks import Candidate, build_candidates, is_test_path, statement
from harnessrl.examples.coding.validate import Validation, validate_all
from harnessrl.schema import GuardPolicy, Task

log = logging.getLogger(__name__)

REPO_DIR = "repo"  # where the repository is in the attempt's home/ (the harness's `$HOME/repo`)
EMPTY_STATEMENT = "empty_statement"
NO_TESTS = "no_tests"
TOO_MANY_TESTS = "too_many_tests"
ALWAYS_SOLVED = "always_solved"
NEVER_SOLVED_OVER_SHARE = "never_solved_over_share"


def prefilter(candidates: list[Candidate], max_tests: int) -> tuple[list[Candidate], Counter[str]]:
    """Drop candidates with an empty statement, no test, or more than `max_tests` tests."""
    kept: list[Candidate] = []
    dropped: Counter[str] = Counter()
    for c in candidates:
        if not c.docstring.strip():
            dropped[EMPTY_STATEMENT] += 1
        elif not c.test_ids:
            dropped[NO_TESTS] += 1
        elif len(c.test_ids) > max_tests:
            dropped[TOO_MANY_TESTS] += 1
        else:
            kept.append(c)
    return kept, dropped


def to_task(c: Candidate, v: Validation, partial_credit: bool = False) -> Task:
    """The validated candidate as a task: the repository and statement for the harness, the
    fix, tests and their outcomes for the grader."""
    text = statement(c.docstring, c.entry_point, c.module_path, v.fail_to_pass)
    tests = {p: t for p, t in c.files.items() if is_test_path(p)}
    return Task(
        task_id=c.task_id,
        input={"statement": text, "files": c.files},
        # the repository is in the attempt's home/ before the harness starts, its tests and test
        # configuration read-only: blocked in the sandbox, flagged by the plain runners (docs/security.md)
        workspace={f"{REPO_DIR}/{p}": t for p, t in c.files.items()},
        guard=GuardPolicy(read_only=sorted({f"{REPO_DIR}/{p.split('/')[0]}" for p in tests})),
        reference={
            "problem_id": c.problem_id,
            "module_path": c.module_path,
            "fixed_module": c.fixed_module,
            "test_files": tests,
            "fail_to_pass": v.fail_to_pass,
            "pass_to_pass": v.pass_to_pass,
            "mutation": c.mutation,
            "partial_credit": partial_credit,
        },
    )


def _bucket(task_id: str, seed: int) -> float:
    """A stable number in [0, 1) per task id and seed."""
    return int(hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()[:12], 16) / 16**12


def select_by_probe(
    solve_counts: dict[str, int], k: int, never_solved_share: float = 0.25, seed: int = 0
) -> tuple[list[str], dict[str, str]]:
    """The keep/drop rule after probing the model `k` times per task.

    A task solved k/k times teaches nothing (dropped, `always_solved`); one with mixed outcomes
    (0 < solved < k) is kept; of the never-solved ones (0/k) a `never_solved_share` fraction is kept,
    picked by a stable hash of the task id (the rest: `never_solved_over_share`). Returns (kept task
    ids in input order, {dropped task id: reason})."""
    if k <= 0:
        raise ValueError("k must be positive: the rule needs at least one probe per task")
    if not 0.0 <= never_solved_share <= 1.0:
        raise ValueError(f"never_solved_share must be in [0, 1], got {never_solved_share}")
    kept: list[str] = []
    dropped: dict[str, str] = {}
    for task_id, solved in solve_counts.items():
        if not 0 <= solved <= k:
            raise ValueError(f"task {task_id}: {solved} solves out of k={k}")
        if solved == k:
            dropped[task_id] = ALWAYS_SOLVED
        elif solved > 0 or _bucket(task_id, seed) < never_solved_share:
            kept.append(task_id)
        else:
            dropped[task_id] = NEVER_SOLVED_OVER_SHARE
    return kept, dropped


def build_tasks(
    max_tasks: int | None = 40,
    per_problem: int = 1,
    max_tests: int = 40,
    runs: int = 3,
    workers: int = 2,
    seed: int = 0,
    partial_credit: bool = False,
) -> tuple[list[Task], dict[str, Any]]:
    """Build, prefilter and validate tasks; returns (valid tasks, statistics)."""
    t0 = time.monotonic()
    candidates = build_candidates(max_tasks, per_problem, seed)
    pre, dropped = prefilter(candidates, max_tests)
    results = validate_all(pre, runs=runs, workers=workers)
    tasks = []
    for c, v in zip(pre, results, strict=True):
        if v.valid:
            tasks.append(to_task(c, v, partial_credit))
        else:
            dropped[str(v.reason)] += 1
    stats: dict[str, Any] = {
        "built": len(candidates),
        "validated": len(tasks),
        "dropped": dict(sorted(dropped.items())),
        "mutations": dict(sorted(Counter(str(t.reference["mutation"]["kind"]) for t in tasks).items())),
        "validation_runs": runs,
        "build_validate_seconds": round(time.monotonic() - t0, 1),
    }
    return tasks, stats


HELDOUT_SHARE = 0.25  # of the HumanEval problems (by a stable hash of the problem id)


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Validated train and held-out tasks (no probe); a problem's mutants all fall in one split,
    so no held-out function is ever trained on. Validation stops once a split has enough tasks."""
    candidates = build_candidates(None, per_problem=3, seed=seed)
    held = [c for c in candidates if _bucket(c.problem_id, seed) < HELDOUT_SHARE]
    train = [c for c in candidates if _bucket(c.problem_id, seed) >= HELDOUT_SHARE]
    return _validated(train, n_train), _validated(held, n_heldout)


def _validated(candidates: list[Candidate], n: int) -> list[Task]:
    """The first `n` candidates that pass the prefilter and validation, validated in chunks."""
    pre, _ = prefilter(candidates, max_tests=40)
    chunk = min(16, n + 2)  # about 85% validate: a chunk a little over n usually suffices
    out: list[Task] = []
    for i in range(0, len(pre), chunk):
        if len(out) >= n:
            break
        part = pre[i : i + chunk]
        out += [to_task(c, v) for c, v in zip(part, validate_all(part), strict=True) if v.valid]
    return out[:n]


def format_table(stats: dict[str, Any]) -> str:
    """The statistics as a two-column text table."""
    rows: list[tuple[str, Any]] = [("built", stats["built"])]
    rows += [(f"dropped: {reason}", n) for reason, n in stats["dropped"].items()]
    rows += [("validated", stats["validated"])]
    if "probe" in stats:
        rows += [(f"probe: {key}", n) for key, n in stats["probe"].items()]
    rows += [("kept", stats["kept"])]
    rows += [(f"mutation: {kind}", n) for kind, n in stats.get("mutations", {}).items()]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value:>6}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m harnessrl.examples.coding.pipeline`."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSONL file of the kept tasks")
    ap.add_argument("--max-tasks", type=int, default=40, help="candidates to build (0: all)")
    ap.add_argument("--per-problem", type=int, default=1, help="mutants per HumanEval problem")
    ap.add_argument("--max-tests", type=int, default=40, help="drop tasks with more tests than this")
    ap.add_argument("--runs", type=int, default=3, help="validation runs of the buggy and fixed repo")
    ap.add_argument("--workers", type=int, default=2, help="concurrent pytest processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partial-credit", action="store_true", help="reward = fraction of tests passing")
    ap.add_argument("--probe-k", type=int, default=0, help="probe the model K times per task (0: skip)")
    ap.add_argument("--probe-config", type=Path, default=Path(__file__).with_name("config.yaml"),
                    help="run config of the probe (engine, model, controller)")  # fmt: skip
    ap.add_argument("--never-solved-share", type=float, default=0.25)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    tasks, stats = build_tasks(args.max_tasks or None, args.per_problem, args.max_tests, args.runs,
                               args.workers, args.seed, args.partial_credit)  # fmt: skip
    if args.probe_k > 0:
        from harnessrl.examples.coding.probe import probe_solve_counts

        counts = probe_solve_counts(tasks, args.probe_config, args.probe_k)
        kept_ids, dropped = select_by_probe(counts, args.probe_k, args.never_solved_share, args.seed)
        solved = Counter(
            "always" if c == args.probe_k else "never" if c == 0 else "mixed" for c in counts.values()
        )
        stats["probe"] = {"k": args.probe_k, **{f"{key}_solved": n for key, n in sorted(solved.items())}}
        for reason in dropped.values():
            stats["dropped"][reason] = stats["dropped"].get(reason, 0) + 1
        keep = set(kept_ids)
        tasks = [t for t in tasks if t.task_id in keep]
    stats["kept"] = len(tasks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    stats_path = args.out.with_name(args.out.stem + ".stats.json")
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    print(format_table(stats))
    print(f"wrote {len(tasks)} tasks to {args.out} and statistics to {stats_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
