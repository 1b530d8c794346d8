"""The runner a run's `controller` config section describes: local, forked from a fork server,
sandboxed (bubblewrap; forked inside one sandbox with `fork_server`), or on Ray (sandboxed or not). Kubernetes runners are built by their own
launcher (docs/kubernetes.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harnessrl.controller.runner import HarnessSpec, Runner
from harnessrl.errors import ConfigError

if TYPE_CHECKING:
    from harnessrl.config import ControllerSection
    from harnessrl.controller.runners.sandbox import SandboxSpec


def make_runner(section: ControllerSection, harness: HarnessSpec | None = None) -> Runner:
    """The runner `section` describes; `ConfigError` when it asks for a sandbox that cannot run here.
    (The sandbox shows what `harness.command` needs by itself: `runners/sandbox_view.py`.)"""
    from harnessrl.controller.runners.sandbox import SandboxRunner, SandboxUnavailable, use_sandbox

    try:
        sandbox = sandbox_spec(section) if use_sandbox(section.sandbox) else None
    except SandboxUnavailable as e:
        raise ConfigError(str(e)) from e
    if section.fork_server and sandbox is None and section.ray_address is None:
        from harnessrl.controller.runners.forkserver import ForkServerRunner

        return ForkServerRunner(section.preload)
    if section.ray_address is not None:
        from harnessrl.controller.runners.ray_runner import RayRunner, RaySpec

        memory = None if section.ray_memory_mb is None else section.ray_memory_mb << 20
        return RayRunner(RaySpec(address=section.ray_address, num_cpus=section.ray_num_cpus, memory_bytes=memory,
                                 resources=dict(section.ray_resources), sandbox=sandbox))  # fmt: skip
    if sandbox is not None and section.fork_server:
        from harnessrl.controller.runners.sandbox_fork import SandboxedForkServerRunner

        return SandboxedForkServerRunner(sandbox, section.preload)
    if sandbox is not None:
        return SandboxRunner(sandbox)
    from harnessrl.controller.runners.local import LocalRunner

    return LocalRunner()


def sandbox_spec(section: ControllerSection) -> SandboxSpec:
    """The `SandboxSpec` of `section`'s sandbox settings."""
    from harnessrl.controller.runners.sandbox import SandboxSpec

    def mb(v: int | None) -> int | None:
        return None if v is None else v << 20

    return SandboxSpec(
        cpu_seconds=section.sandbox_cpu_seconds,
        memory_bytes=mb(section.sandbox_memory_mb),
        max_processes=section.sandbox_max_processes,
        max_file_bytes=mb(section.sandbox_max_file_mb),
        cgroup=section.sandbox_cgroup,
        cgroup_memory_bytes=mb(section.sandbox_cgroup_memory_mb),
        cgroup_max_pids=section.sandbox_cgroup_max_pids,
        ro_paths=tuple(section.sandbox_ro_paths),
    )  # sandbox_hide_git / sandbox_disable_git are guard aliases now (RunConfig.guard)
