"""Runnable examples: task data + an unmodified-style harness + a grader (+ a config)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harnessrl.controller.grader import Grader
from harnessrl.schema import Task


@dataclass(frozen=True)
class ExampleSpec:
    """What the trainer needs of an example."""

    name: str
    build_splits: Callable[[int, int, int], tuple[list[Task], list[Task]]]  # (n_train, n_heldout, seed)
    grader: Grader
    harness_command: list[str]
    config_path: Path


EXAMPLES = {
    "calc": "harnessrl.examples.calc",
    "search": "harnessrl.examples.search",
    "instruct": "harnessrl.examples.instruct",
    "calc_slow": "harnessrl.examples.calc_slow",
    "calc_chain": "harnessrl.examples.calc_chain",
    "coding": "harnessrl.examples.coding",
}


def get_example(name: str) -> ExampleSpec:
    """The example called `name`; the error lists the known ones."""
    if name not in EXAMPLES:
        raise KeyError(f"unknown example '{name}'; known: {', '.join(sorted(EXAMPLES))}")
    module = importlib.import_module(EXAMPLES[name])
    spec: ExampleSpec = module.spec()
    return spec


def write_tasks(tasks: list[Task], path: Path) -> None:
    """Write tasks as JSONL (one `Task` per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
