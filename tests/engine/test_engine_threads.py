"""The engine's torch threads: `threads` when set, else OMP_NUM_THREADS (as torch's own default), else
every core this process may use (what the suite's xdist workers rely on: tests/support/workers.py)."""

from __future__ import annotations

import os

import pytest

from harnessrl.engine.config import EngineConfig


def test_threads_then_omp_num_threads_then_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineConfig(threads=3).num_threads == 3
    assert EngineConfig().num_threads == 1
    for unusable in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert EngineConfig().num_threads == cores
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert EngineConfig().num_threads == cores
