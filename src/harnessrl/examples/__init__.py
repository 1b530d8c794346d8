"""Runnable examples: task data + an unmodified-style harness + a grader, each declared by a config
on the same `harness`, `tasks` and `grader` keys a user's project uses (docs/config.md).

`example_config(name)` is the path of a built-in config; `get_example(name)` resolves it like any
other config (there is no separate registry behind it).
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.runs.project import Project
from harnessrl.schema import Task

ExampleSpec = Project  # the resolved form of an example's config

_HERE = Path(__file__).parent
EXAMPLES = tuple(sorted(p.parent.name for p in _HERE.glob("*/config.yaml")))


def example_config(name: str) -> Path:
    """The packaged config of the example called `name`; the error lists the known ones."""
    path = _HERE / name / "config.yaml"
    if name not in EXAMPLES or not path.is_file():
        raise KeyError(f"unknown example '{name}'; known: {', '.join(EXAMPLES)}")
    return path


def get_example(name: str) -> Project:
    """The example called `name`, resolved from its config."""
    from harnessrl.config import load_config
    from harnessrl.runs.project import resolve_project

    path = example_config(name)
    return resolve_project(load_config(path), config_path=path)


def write_tasks(tasks: list[Task], path: Path) -> None:
    """Write tasks as JSONL (one `Task` per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
