"""The `calc` example: arithmetic problems, a calculator-tool harness on the openai SDK, exact grading."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.examples import ExampleSpec


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.calc import task

    return ExampleSpec(
        name="calc",
        build_splits=task.build_splits,
        grader=task.grade,
        harness_command=[sys.executable, str(Path(__file__).with_name("harness.py"))],
        config_path=Path(__file__).with_name("config.yaml"),
    )
