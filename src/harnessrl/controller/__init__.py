"""Controller: turns tasks into rollouts, runs harnesses, grades them."""

from harnessrl.controller.controller import Controller, RolloutOutcome, RolloutRequest
from harnessrl.controller.forkserver import ForkServerError, ForkServerRunner
from harnessrl.controller.grader import CommandGrader, Grader, GraderError
from harnessrl.controller.kubernetes import KubernetesRunner, KubernetesSpec
from harnessrl.controller.ray_runner import RayRunner, RaySpec  # ray itself is imported lazily
from harnessrl.controller.runner import AttemptResult, AttemptSpec, HarnessSpec, LocalRunner, Runner
from harnessrl.controller.sandbox import SandboxRunner, SandboxSpec

__all__ = [
    "AttemptResult",
    "AttemptSpec",
    "CommandGrader",
    "Controller",
    "ForkServerError",
    "ForkServerRunner",
    "Grader",
    "GraderError",
    "HarnessSpec",
    "KubernetesRunner",
    "KubernetesSpec",
    "LocalRunner",
    "RayRunner",
    "RaySpec",
    "RolloutOutcome",
    "RolloutRequest",
    "Runner",
    "SandboxRunner",
    "SandboxSpec",
]
