"""The `instruct` example: writing requests with verifiable constraints (length, keywords, format, JSON,
casing, sections, …), a single-call harness on the openai SDK, reward = fraction of constraints met."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.examples import ExampleSpec


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.instruct import task

    return ExampleSpec(
        name="instruct",
        build_splits=task.build_splits,
        grader=task.grade,
        harness_command=[sys.executable, str(Path(__file__).with_name("harness.py"))],
        config_path=Path(__file__).with_name("config.yaml"),
    )
