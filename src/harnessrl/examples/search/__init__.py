"""The `search` example: multi-hop questions over a generated knowledge base of fictional entities,
a harness on the openai SDK with a BM25 `search` tool, and an F1 / exact-match grader."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.examples import ExampleSpec


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.search import task

    return ExampleSpec(
        name="search",
        build_splits=task.build_splits,
        grader=task.grade,
        harness_command=[sys.executable, str(Path(__file__).with_name("harness.py"))],
        config_path=Path(__file__).with_name("config.yaml"),
    )
