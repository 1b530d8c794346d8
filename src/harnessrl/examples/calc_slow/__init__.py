"""`calc_slow`: the calc example with a slow calculator whose latency has a long tail (lognormal,
median 6 s, σ 1.0, capped at 60 s) on the training tasks — the workload of the async-vs-sync benchmark
(`bench/train_async.py`). Held-out tasks have no delay: evaluation measures reward, not time."""

from __future__ import annotations

from typing import Any

from harnessrl.schema import Task

LATENCY: dict[str, Any] = {"median_s": 6.0, "sigma": 1.0, "max_s": 60.0}


def build_splits(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """calc's splits, with the slow tool on every training task."""
    from harnessrl.examples.calc import task

    train, heldout = task.build_splits(n_train, n_heldout, seed)
    slow = [t.model_copy(update={"input": {**t.input, "tool_latency": LATENCY}}) for t in train]
    return slow, heldout
