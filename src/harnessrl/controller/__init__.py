"""Controller: turns tasks into rollouts, runs harnesses, grades them.

`controller` (rollouts, attempts, retries, grading) runs each attempt through a runner: `runner` (the
contract: specs, results, the `Runner` lifecycle), `runners/` (the backends: `local` subprocesses,
`forkserver` + `fork_zygote` for Python harnesses forked from a preloaded process, `sandbox` +
`sandbox_init` + `bridge` + `cgroups` for bubblewrap — the default wherever it works —, `sandbox_fork` +
`sandbox_zygote` for Python harnesses forked inside one bubblewrap sandbox, `ray_runner`,
`kubernetes*`), `factory` (the runner a config's `controller` section describes). `isolation` keeps an unsandboxed harness to its own rollout (a uid of its
own as root) and cleans `output/` after each attempt of the local runners (Ray runs them on its nodes);
docs/security.md says what each mode guarantees.
`grader` runs graders outside the harness.
"""

from harnessrl.controller.controller import Controller, RolloutOutcome, RolloutRequest, sibling_requests
from harnessrl.controller.grader import CommandGrader, Grader, GraderError
from harnessrl.controller.runner import AttemptResult, AttemptSpec, HarnessSpec, Runner, RunnerBase
from harnessrl.controller.runners.forkserver import ForkServerError, ForkServerRunner
from harnessrl.controller.runners.kubernetes import KubernetesRunner, KubernetesSpec
from harnessrl.controller.runners.local import LocalRunner
from harnessrl.controller.runners.ray_runner import RayRunner, RaySpec  # ray itself is imported lazily
from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxSpec
from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner

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
    "RunnerBase",
    "SandboxRunner",
    "SandboxSpec",
    "SandboxedForkServerRunner",
    "sibling_requests",
]
