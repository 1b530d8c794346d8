"""The `calc` example: arithmetic problems, a calculator-tool harness on the openai SDK, exact grading."""

from __future__ import annotations

from pathlib import Path

from harnessrl.examples import ExampleSpec, python_module_command


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.calc import task

    return ExampleSpec(
        name="calc",
        build_splits=task.build_splits,
        grader=task.grade,
        harness_command=python_module_command("harnessrl.examples.calc.harness"),
        config_path=Path(__file__).with_name("config.yaml"),
    )
