"""Training metrics to a JSONL file and the experiment trackers of `train.log_to` (`trainer.trackers`)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from harnessrl.trainer.trackers import TensorBoardTracker, Tracker, TrackerError, scalars

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object per step to `metrics.jsonl` and mirrors scalars (and sample tables) to
    the trackers; by default TensorBoard when it is installed."""

    def __init__(self, run_dir: Path, trackers: list[Tracker] | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if trackers is None:
            try:
                trackers = [TensorBoardTracker(run_dir)]
            except TrackerError:
                trackers = []
        self.trackers = trackers

    def _each(self, what: str, call: Any) -> None:
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:  # a tracker never costs the run its metrics: drop it, say so once
                log.warning("event=tracker_failed tracker=%s during=%s error=%r (dropped)", t.name, what, e)
                self.trackers.remove(t)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record the metrics of one step."""
        with self.path.open("a") as f:
            f.write(json.dumps(finite_json({"step": step, **values}), allow_nan=False) + "\n")
        numbers = scalars(values)
        self._each("log", lambda t: t.log(step, numbers))

    def log_samples(self, step: int, rows: list[list[Any]]) -> None:
        """Record a step's table of sample completions (`trackers.sample_table`) in the trackers."""
        self._each("log_samples", lambda t: t.log_samples(step, rows))

    def read(self) -> list[dict[str, Any]]:
        """All records logged so far (also those of earlier runs in the same directory)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` (a resumed run does them again)."""
        records = self.read()
        kept = [r for r in records if int(r.get("step", 0)) <= step]
        if len(kept) < len(records):
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        """Flush and close the trackers."""
        self._each("close", lambda t: t.close())


def finite_json(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def mean_ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95% interval: Wilson score for 0/1 values, normal approximation otherwise."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    m = sum(values) / n
    if all(v in (0.0, 1.0) for v in values):
        z = 1.959964
        denom = 1 + z * z / n
        centre = (m + z * z / (2 * n)) / denom
        half = z * math.sqrt(m * (1 - m) / n + z * z / (4 * n * n)) / denom
        return m, centre - half, centre + half
    var = sum((v - m) ** 2 for v in values) / max(n - 1, 1)
    half = 1.959964 * math.sqrt(var / n)
    return m, m - half, m + half
