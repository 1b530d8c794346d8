"""`harnessrl init DIR`: a working project to start from — a small openai-SDK harness with one tool,
a task file, a grader and a config that `harnessrl check` passes and `harnessrl train` trains."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

TEMPLATE = Path(__file__).parent / "templates" / "project"
FILES = ("harness.py", "grader.py", "config.yaml")


class ScaffoldError(RuntimeError):
    """The project cannot be written where asked; nothing was changed."""


def init_project(directory: Path, n_tasks: int = 80, seed: int = 0) -> list[Path]:
    """Write the project into `directory` (created if needed); refuses to overwrite any file.
    Returns the files written."""
    targets = [directory / name for name in (*FILES, "tasks.jsonl")]
    existing = [str(p) for p in targets if p.exists()]
    if existing:
        raise ScaffoldError(f"{', '.join(existing)} already exist(s); choose an empty or new folder")
    if directory.exists() and not directory.is_dir():
        raise ScaffoldError(f"{directory} is a file")
    directory.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(TEMPLATE / name, directory / name)
    (directory / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in make_tasks(n_tasks, seed)))
    return targets


def make_tasks(n: int, seed: int = 0) -> list[dict[str, object]]:
    """`n` distinct two-number multiplication questions with their answers as references."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    tasks: list[dict[str, object]] = []
    while len(tasks) < n:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        phrasing = rng.choice(["What is {a} times {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}."])
        tasks.append(
            {
                "task_id": f"mul-{len(tasks)}",
                "input": {"question": phrasing.format(a=a, b=b)},
                "reference": {"answer": a * b},
            }
        )
    return tasks
