"""The controller's runner follows the config: sandboxed by default wherever bubblewrap works, plain when
chosen or when it cannot run (loudly), on Ray (with or without a sandbox)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harnessrl.config import ConfigError, load_config
from harnessrl.controller import LocalRunner, RayRunner, SandboxRunner
from harnessrl.controller.factory import make_runner
from harnessrl.controller.runners.sandbox import bwrap_problem, use_sandbox

BWRAP_WORKS = bwrap_problem() is None


def test_runner_follows_the_config() -> None:
    default = load_config(None, []).controller
    assert default.sandbox == "auto"
    assert type(make_runner(default)) is (SandboxRunner if BWRAP_WORKS else LocalRunner)
    assert type(make_runner(load_config(None, ["controller.sandbox=false"]).controller)) is LocalRunner
    if BWRAP_WORKS:
        assert type(make_runner(load_config(None, ["controller.sandbox=true"]).controller)) is SandboxRunner
    ray = make_runner(load_config(None, ["controller.ray_address=127.0.0.1:6379", "controller.ray_num_cpus=0.5",
                             "controller.ray_resources={worker: 0.1}", "controller.ray_memory_mb=64",
                             "controller.sandbox=false"]).controller)  # fmt: skip
    assert isinstance(ray, RayRunner) and ray.ray_spec.sandbox is None
    assert ray.ray_spec.address == "127.0.0.1:6379" and ray.ray_spec.num_cpus == 0.5
    assert ray.ray_spec.resources == {"worker": 0.1} and ray.ray_spec.memory_bytes == 64 << 20
    sandboxed = make_runner(load_config(None, ["controller.ray_address=auto"]).controller)
    assert (sandboxed.ray_spec.sandbox is not None) is BWRAP_WORKS
    with pytest.raises(ConfigError, match=r"controller\.sandbox"):
        load_config(None, ["controller.sandbox=sometimes"])


@pytest.fixture
def broken_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `bwrap` first on PATH that fails the way a kernel without namespaces makes it fail."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    return fake


def test_auto_falls_back_loudly_and_true_refuses(
    broken_bwrap: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "No permissions to create new namespace" in (bwrap_problem() or "")
    with caplog.at_level(logging.WARNING):
        runner = make_runner(load_config(None, []).controller)
    assert type(runner) is LocalRunner
    assert "event=sandbox_unavailable" in caplog.text
    err = capsys.readouterr().err
    assert "WARNING: harnesses run unsandboxed" in err and "No permissions" in err
    make_runner(load_config(None, []).controller)
    assert "WARNING" not in capsys.readouterr().err  # once per process
    with pytest.raises(ConfigError, match=r"sandbox is true but the sandbox cannot run here.*No permissions"):
        make_runner(load_config(None, ["controller.sandbox=true"]).controller)
    assert use_sandbox(False) is False  # chosen: no probe, no warning
    assert capsys.readouterr().err == ""


def test_async_schedule_needs_enough_groups_in_flight() -> None:
    with pytest.raises(ConfigError, match="max_inflight_groups"):
        load_config(None, ["train.schedule=async", "train.batch_groups=8", "train.max_inflight_groups=4"])
    with pytest.raises(ConfigError, match="tis_cap"):
        load_config(None, ["train.tis_cap=0"])
