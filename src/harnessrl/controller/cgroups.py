"""A cgroup per sandboxed attempt: one memory limit and one process limit for all of its processes
together (rlimits bound each process alone), where this machine lets the controller create one.

Works with cgroup v1 (`memory` and `pids` hierarchies, as on hybrid hosts) and v2 (a child of the
controller's own cgroup whose `memory`/`pids` controllers are enabled for children). The attempt
joins it before bwrap starts (`join_command` wraps the command in a two-line shell that writes its
own pid into each `cgroup.procs` and execs), so every process of the sandbox is inside from birth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")


def _own_paths() -> dict[str, str]:
    """The controller's cgroup path per hierarchy: {"memory": "/a/b", "pids": "/", "": "/"} ("" = v2)."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                paths[c] = path
    return paths


def _parents(memory: bool, pids: bool) -> dict[str, Path] | None:
    """Where to create the attempt's cgroups: {controller: parent directory}, or None if nowhere."""
    own = _own_paths()
    if (ROOT / "cgroup.controllers").exists():  # pure v2
        parent = ROOT / own.get("", "/").lstrip("/")
        enabled = (parent / "cgroup.subtree_control").read_text().split() if parent.exists() else []
        wanted = [c for c, on in (("memory", memory), ("pids", pids)) if on]
        ok = all(c in enabled for c in wanted) and os.access(parent, os.W_OK)
        return dict.fromkeys(wanted, parent) if ok else None
    found: dict[str, Path] = {}
    for c, on in (("memory", memory), ("pids", pids)):
        if on:
            parent = ROOT / c / own.get(c, "/").lstrip("/")
            if not (parent / "cgroup.procs").exists() or not os.access(parent, os.W_OK):
                return None
            found[c] = parent
    return found


class AttemptCgroup:
    """The cgroup(s) of one attempt: `create()` makes them with their limits, `aclose()` kills what is
    left inside and removes them. `available` is False where none can be made: nothing is limited."""

    def __init__(self, memory_bytes: int | None, max_pids: int | None) -> None:
        self.memory_bytes, self.max_pids = memory_bytes, max_pids
        self.dirs: list[Path] = []
        self.available = False

    def create(self) -> AttemptCgroup:
        """Create the cgroups and set their limits; leaves `available` False where it cannot."""
        parents = _parents(self.memory_bytes is not None, self.max_pids is not None)
        if not parents:
            return self
        name = f"harnessrl-{secrets.token_hex(6)}"
        try:
            for controller, parent in parents.items():
                d = parent / name
                if d not in self.dirs:
                    d.mkdir()
                    self.dirs.append(d)
                self._limit(controller, d)
        except OSError as e:
            log.warning("event=cgroup_unavailable error=%s", e)
            self._remove()
            return self
        self.available = True
        return self

    def _limit(self, controller: str, d: Path) -> None:
        v2 = (d / "cgroup.controllers").exists()
        if controller == "memory":
            value = str(self.memory_bytes)
            (d / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(value)
            swap = d / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
            with contextlib.suppress(OSError):  # absent without swap accounting
                swap.write_text("0" if v2 else value)
        else:
            (d / "pids.max").write_text(str(self.max_pids))

    def join_command(self, command: list[str]) -> list[str]:
        """`command` run so that it (and all it starts) lives in this attempt's cgroups."""
        if not self.available:
            return command
        n = len(self.dirs)
        script = " && ".join(f'echo $$ > "${i + 1}"' for i in range(n)) + f' && shift {n} && exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *(str(d / "cgroup.procs") for d in self.dirs), *command]

    def oom_kills(self) -> int:
        """How many processes the memory limit killed (0 when not known)."""
        for d in self.dirs:
            for f, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                with contextlib.suppress(OSError, ValueError):
                    for line in (d / f).read_text().splitlines():
                        if line.startswith(key + " "):
                            return int(line.split()[1])
        return 0

    async def aclose(self) -> None:
        """Kill whatever is left inside, then remove the cgroups (retrying while processes exit:
        the sandbox's last ones are usually gone within a few milliseconds of bwrap's exit)."""
        delay, waited = 0.001, 0.0
        while waited < 5.0:
            pids = set()
            for d in self.dirs:
                with contextlib.suppress(OSError, ValueError):
                    pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self._remove():
                return
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.1)
        log.warning("event=cgroup_not_removed dirs=%s", [str(d) for d in self.dirs])

    def _remove(self) -> bool:
        for d in list(self.dirs):
            try:
                d.rmdir()
                self.dirs.remove(d)
            except FileNotFoundError:
                self.dirs.remove(d)
            except OSError:
                return False
        return True
