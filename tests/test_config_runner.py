"""The controller's runner follows the config: local, sandboxed, on Ray (with or without a sandbox)."""

from __future__ import annotations

import pytest

from harnessrl.config import ConfigError, load_config
from harnessrl.controller import LocalRunner, RayRunner, SandboxRunner


def test_runner_follows_the_config() -> None:
    assert type(load_config(None, []).controller.runner()) is LocalRunner
    assert type(load_config(None, ["controller.sandbox=true"]).controller.runner()) is SandboxRunner
    ray = load_config(None, ["controller.ray_address=127.0.0.1:6379", "controller.ray_num_cpus=0.5",
                             "controller.ray_resources={worker: 0.1}", "controller.ray_memory_mb=64"]).controller.runner()  # fmt: skip
    assert isinstance(ray, RayRunner) and ray.ray_spec.sandbox is None
    assert ray.ray_spec.address == "127.0.0.1:6379" and ray.ray_spec.num_cpus == 0.5
    assert ray.ray_spec.resources == {"worker": 0.1} and ray.ray_spec.memory_bytes == 64 << 20
    sandboxed = load_config(
        None, ["controller.ray_address=auto", "controller.sandbox=true"]
    ).controller.runner()
    assert sandboxed.ray_spec.sandbox is not None


def test_async_schedule_needs_enough_groups_in_flight() -> None:
    with pytest.raises(ConfigError, match="max_inflight_groups"):
        load_config(None, ["train.schedule=async", "train.batch_groups=8", "train.max_inflight_groups=4"])
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(None, ["train.tis_cap=0"])
