"""Controller: turns tasks into rollouts, runs harnesses, grades them."""

from harnessrl.controller.controller import Controller, RolloutOutcome, RolloutRequest
from harnessrl.controller.grader import Grader, GraderError
from harnessrl.controller.runner import AttemptResult, AttemptSpec, HarnessSpec, LocalRunner

__all__ = [
    "AttemptResult",
    "AttemptSpec",
    "Controller",
    "Grader",
    "GraderError",
    "HarnessSpec",
    "LocalRunner",
    "RolloutOutcome",
    "RolloutRequest",
]
