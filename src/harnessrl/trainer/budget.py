"""`train.time_budget_s`: a training run (RL's sync and async schedules, SFT) stops cleanly after the
step during which its training time ran out and saves that step's checkpoint (`checkpoint_due` with
`stopping`), so `--resume` continues from exactly there. The clock starts when the loop does."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class TimeBudget:
    """The training time a run may spend (`seconds`; None: no limit), counted from `started`."""

    seconds: float | None
    started: float = field(default_factory=time.monotonic)

    def stops(self, step: int, planned: int) -> bool:
        """Whether the run stops after `step` of `planned` because the budget is spent (never after the
        last step: the run ends there anyway)."""
        return self.seconds is not None and step < planned and time.monotonic() - self.started >= self.seconds

    def note_stop(
        self, step: int, planned: int, checkpoint: Path | None, notify: Callable[[str], None]
    ) -> None:
        """Log, and tell the user (`notify`), that the budget stopped an RL run after `step` of `planned`,
        with `checkpoint` saved (None: `train.checkpoint_every` 0), and how the run goes on."""
        assert self.seconds is not None
        log.info("event=time_budget_stop step=%d of=%d budget_s=%g checkpoint=%s",
                 step, planned, self.seconds, checkpoint)  # fmt: skip
        line = stop_line(self.seconds, step, planned, checkpoint.name if checkpoint else None, "--resume")
        notify(f"{line}; the evaluation after training runs now")


def stop_line(budget_s: float, step: int, planned: int, checkpoint: str | None, resume: str) -> str:
    """What a run the budget stopped tells the user: after which step, the checkpoint of that step (its
    folder name; None with `train.checkpoint_every` 0) and how to continue (`resume`)."""
    head = f"train.time_budget_s ({budget_s:g} s) ran out after step {step} of {planned}"
    if checkpoint is None:
        return f"{head}; no checkpoint saved (train.checkpoint_every 0), so a resume would start over"
    return f"{head}; checkpoint {checkpoint} saved; continue with: {resume}"
