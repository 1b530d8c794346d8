"""`calc_chain`: the calc harness on a running total, 1 to 10 steps per task, each step a fresh
conversation with the calculator tool (about two calls a step) — rollouts of 2 to 20 calls, the
workload of the ablation benchmark (`bench/train_ablation.py --example calc_chain`)."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.examples import ExampleSpec


def spec() -> ExampleSpec:
    """The example's data, grader, harness command and config."""
    from harnessrl.examples.calc_chain import task

    calc_dir = Path(__file__).parent.parent / "calc"
    return ExampleSpec(
        name="calc_chain",
        build_splits=task.build_splits,
        grader=task.grade,
        harness_command=[sys.executable, str(calc_dir / "harness.py")],
        config_path=Path(__file__).with_name("config.yaml"),
    )
