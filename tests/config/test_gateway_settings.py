"""The gateway's timeouts and WAL limit in the run config, and the rule that ties a call's time limit to
the harness's: a call an overloaded engine cannot finish fails before the harness is killed."""

from __future__ import annotations

import pytest

from harnessrl.config import ConfigError, load_config


def test_the_call_timeout_follows_the_harness_timeout_unless_set() -> None:
    cfg = load_config(None, ["controller.harness_timeout_s=100"])
    assert cfg.gateway.timeouts(cfg.controller.harness_timeout_s) == (80.0, 80.0)
    cfg = load_config(None, ["controller.harness_timeout_s=100", "gateway.upstream_timeout_s=30"])
    assert cfg.gateway.timeouts(100.0) == (30.0, 80.0)
    cfg = load_config(None, ["gateway.call_timeout_s=50", "gateway.upstream_timeout_s=90"])
    assert cfg.gateway.timeouts(cfg.controller.harness_timeout_s) == (50.0, 50.0)  # a try fits in the call
    assert load_config(None, ["gateway.wal_limit_mb=16"]).gateway.wal_limit_mb == 16


def test_a_call_timeout_past_the_harness_timeout_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["controller.harness_timeout_s=100", "gateway.call_timeout_s=100"])
    assert "gateway.call_timeout_s (100)" in str(e.value) and "controller.harness_timeout_s (100)" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="stream_open_timeout_s"):
        load_config(None, ["gateway.stream_open_timeout_s=0"])
