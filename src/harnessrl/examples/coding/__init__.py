"""The `coding` example: SWE-smith-style bug-fix tasks built from HumanEval (a tiny repository
with a synthesised bug and pytest tests), the real `mini-swe-agent` as the harness, and a grader
that runs the task's tests outside the sandbox on the agent's changes. See docs/examples/coding.md."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.examples import ExampleSpec


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.coding import grader, pipeline

    return ExampleSpec(
        name="coding",
        build_splits=pipeline.build_splits,
        grader=grader.grade,
        harness_command=[sys.executable, str(Path(__file__).with_name("harness.py"))],
        config_path=Path(__file__).with_name("config.yaml"),
    )
