"""What a child process does to itself before exec, shared by the services (engine, gateway, vLLM) and
the controller's runners (harnesses). Standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def die_with_parent() -> None:
    """In a child before exec: SIGKILL it when its parent dies (Linux PR_SET_PDEATHSIG), so a run or a
    controller killed with -9 leaves no engine, gateway or harness running unowned."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
