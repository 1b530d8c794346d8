"""The suite under pytest-xdist (`make test` runs it on `-n 2` workers; a pytest plugin, loaded by
tests/conftest.py): one torch/OpenMP thread per worker and in every process a worker starts.

Two workers on two cores that each ran torch with an OpenMP team of two would put four spinning threads
on two cores; a team whose partner is descheduled waits at every barrier, and small matmuls then ran up
to 31x slower. With one thread each there is no team to wait for: the kernel shares the cores between
the workers' processes. The variables are set before the workers start (they inherit them, and so do the
engines, trainers and harnesses the tests start: torch, libgomp and the engine's default `threads` read
OMP_NUM_THREADS), and again in each worker for a torch a plugin may have imported already.
"""

from __future__ import annotations

import os
import sys

import pytest

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def under_workers(config: pytest.Config) -> bool:
    """True in an xdist worker, and in the process that starts workers (`-n N`, N > 0)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or bool(getattr(config.option, "numprocesses", 0))


def one_thread() -> None:
    """One intra-op thread for torch, OpenMP and BLAS here and in every child started from now on."""
    for var in THREAD_VARS:
        os.environ[var] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def torch_threads(default: int = 2) -> int:
    """Threads for an engine a test builds in its own process: 1 under workers, else `default`."""
    return 1 if os.environ.get("PYTEST_XDIST_WORKER") else default


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Before xdist starts its workers (they start at session start), and in each worker."""
    if under_workers(config):
        one_thread()
