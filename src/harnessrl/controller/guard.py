"""Guards against reward hacking: what a task lets its harness touch (`schema.GuardPolicy`), and the
check that runs where the kernel cannot enforce it (docs/security.md, "Guards").

Who guarantees what:
- the sandbox (`runners/sandbox.py`) *blocks*: hidden paths are an empty tmpfs (or `/dev/null`) in
  its view, read-only paths a read-only bind, egress only to the listed host:port through the same
  relay as the gateway, `no_git` makes the git program unrunnable;
- the plain and fork-server runners cannot hide a path or bound the network, so a run whose guard asks
  for `hidden`, `egress` or `no_git` is refused before it starts (`guard_problem`); `read_only` is
  *checked*: every file under a read-only pattern is hashed before the attempt and after it, and an
  attempt that changed, removed or added one is flagged (`details["hacking"]["guard"]`);
- the Ray runner guarantees what its inner runner (sandbox or plain) does, on the node;
- any other runner (Kubernetes) refuses every guard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

from harnessrl.errors import ConfigError
from harnessrl.schema import GuardPolicy

log = logging.getLogger(__name__)

MAX_HASHED_FILES = 10_000  # files under read-only patterns hashed per attempt (more: flagged as such)


class GuardUnenforceable(ConfigError):
    """A task's guard asks for something the chosen runner cannot enforce; the run does not start."""


def plain_runner_problem(guard: GuardPolicy | None) -> str | None:
    """Why a runner without a sandbox (plain subprocess, fork server) cannot honour `guard`, or None:
    it can check read-only paths after the attempt, but hide nothing and bound no network."""
    if guard is None:
        return None
    asks = [f"hidden {guard.hidden}" if guard.hidden else "", f"egress {guard.egress}" if guard.egress else "",
            "no_git" if guard.no_git else ""]  # fmt: skip
    asks = [a for a in asks if a]
    if not asks:
        return None
    return (f"the guard asks for {', '.join(asks)}, which a runner without a sandbox cannot enforce "
            "(it checks read_only paths only); set controller.sandbox: true where bubblewrap works, or "
            "drop those entries (docs/security.md, Guards)")  # fmt: skip


def write_workspace(workspace: dict[str, str], home: Path) -> None:
    """Write a task's `workspace` files under the attempt's `home/` (before the harness starts)."""
    for rel, text in workspace.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        path.write_text(text)


def matched(home: Path, patterns: list[str]) -> list[Path]:
    """The paths under `home` that the relative glob `patterns` name (links are not followed out)."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        if pattern.startswith("/"):
            continue
        for p in sorted(home.glob(pattern)):
            if _inside(p, home):
                found[p] = None
    return list(found)


def _inside(path: Path, root: Path) -> bool:
    try:
        return os.path.realpath(path.parent).startswith(os.path.realpath(root))
    except OSError:
        return False


def snapshot(home: Path, patterns: list[str]) -> dict[str, str]:
    """{path relative to home: digest} of every file, link and directory under the read-only
    `patterns` (a directory counts with everything below it). The digest of a file is its SHA-256,
    of a link its target, of a directory "dir"."""
    out: dict[str, str] = {}
    for top in matched(home, patterns):
        for path in [top, *(_walk(top) if top.is_dir() and not top.is_symlink() else [])]:
            if len(out) >= MAX_HASHED_FILES:
                out["<too many files>"] = "x"
                return out
            out[path.relative_to(home).as_posix()] = _digest(path)
    return out


def _walk(top: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(top):  # never follows links into directories
        dirnames.sort()
        found += [Path(dirpath, n) for n in sorted(dirnames + filenames)]
    return found


def _digest(path: Path) -> str:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return "link:" + os.readlink(path)
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        if not stat.S_ISREG(st.st_mode):
            return "special"
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()
    except OSError as e:
        return f"unreadable:{e.errno}"


def changed(before: dict[str, str], after: dict[str, str]) -> dict[str, list[str]]:
    """What an attempt did to its read-only paths: {"modified", "removed", "added"} (non-empty only)."""
    out = {
        "modified": sorted(p for p in before.keys() & after.keys() if before[p] != after[p]),
        "removed": sorted(before.keys() - after.keys()),
        "added": sorted(after.keys() - before.keys()),
    }
    return {k: v for k, v in out.items() if v}


class ReadOnlyWatch:
    """Hashes an attempt's read-only paths before it runs; `findings()` after it says what changed."""

    def __init__(self, guard: GuardPolicy | None, workdir: Path) -> None:
        self.home = workdir / "home"
        self.patterns = list(guard.read_only) if guard is not None else []
        self.before = snapshot(self.home, self.patterns) if self.patterns else {}

    def findings(self) -> dict[str, Any] | None:
        """The changes to read-only paths (for `details["hacking"]["guard"]`), None when none."""
        if not self.patterns:
            return None
        found = changed(self.before, snapshot(self.home, self.patterns))
        if not found:
            return None
        log.warning("event=guard_read_only_changed home=%s changes=%s", self.home, found)
        return {"read_only_changed": found}
