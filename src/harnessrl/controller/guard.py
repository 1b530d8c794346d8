"""Guards against reward hacking: what a task lets its harness touch (`schema.GuardPolicy`), and the
check that runs where the kernel cannot enforce it (docs/security.md, "Guards").

Who guarantees what:
- the sandbox (`runners/sandbox.py`) *blocks*: hidden paths are an empty tmpfs (or `/dev/null`) in
  its view, read-only paths a read-only bind, egress only to the listed host:port through the same
  relay as the gateway, `no_git` makes the git program unrunnable;
- the plain and fork-server runners cannot hide a path or bound the network, so a run whose guard asks
  for `hidden`, `egress` or `no_git` is refused before it starts (`guard_problem`); `read_only` is
  *checked*: every file under a read-only pattern is hashed (and kept) before the attempt and hashed
  after it; an attempt that changed, removed or added one is a violation (`details["hacking"]["guard"]`),
  and the originals are put back before the grader runs, so the grader reads what the task gave;
- the Ray runner guarantees what its inner runner (sandbox or plain) does, on the node;
- any other runner (Kubernetes) refuses every guard.

What a violation costs is `GuardPolicy.on_violation` (`violation_reward`): "zero" (the default: the reward
is 0 whatever the grader said), "drop" (the rollout leaves the batch) or "flag" (the reward stands).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harnessrl.errors import ConfigError
from harnessrl.schema import GuardPolicy, RewardIn

log = logging.getLogger(__name__)

MAX_HASHED_FILES = 10_000  # files under read-only patterns hashed per attempt (more: flagged as such)
TOO_MANY = "<too many files>"
MAX_KEPT_BYTES = 256 << 20  # of read-only file contents kept per attempt to put back (more: not restored)


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
    """Whether `path`'s folder, links resolved, is `root` or below it (by path components: `/x/home2`
    is not inside `/x/home`)."""
    try:
        parent, top = os.path.realpath(path.parent), os.path.realpath(root)
        return os.path.commonpath([parent, top]) == top
    except (OSError, ValueError):
        return False


def snapshot(home: Path, patterns: list[str]) -> dict[str, str]:
    """{path relative to home: digest} of every file, link and directory under the read-only
    `patterns` (a directory counts with everything below it). The digest of a file is its SHA-256,
    of a link its target, of a directory "dir"."""
    out: dict[str, str] = {}
    for top in matched(home, patterns):
        for path in [top, *(_walk(top) if top.is_dir() and not top.is_symlink() else [])]:
            if len(out) >= MAX_HASHED_FILES:
                out[TOO_MANY] = "x"
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


@dataclass
class Kept:
    """A read-only path as it was before the attempt: a file's bytes and mode, a link's target, a folder."""

    kind: str  # "file", "link", "dir"; "lost" where it could not be kept (too big, unreadable, special)
    data: bytes = b""
    mode: int = 0o755


def keep(home: Path, rels: list[str], budget: int = MAX_KEPT_BYTES) -> dict[str, Kept]:
    """What `restore` needs to put the paths `rels` (relative to `home`) back as they are now."""
    out: dict[str, Kept] = {}
    for rel in rels:
        path = home / rel
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = Kept("link", os.readlink(path).encode())
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = Kept("dir", mode=stat.S_IMODE(st.st_mode))
            elif stat.S_ISREG(st.st_mode) and st.st_size <= budget:
                data = path.read_bytes()
                budget -= len(data)
                out[rel] = Kept("file", data, stat.S_IMODE(st.st_mode))
            else:
                out[rel] = Kept("lost")
        except OSError:
            out[rel] = Kept("lost")
    return out


def restore(home: Path, kept: dict[str, Kept], found: dict[str, list[str]]) -> list[str]:
    """Undo what an attempt did to its read-only paths (`changed`'s findings): added paths removed,
    modified and removed ones written back from `kept`, parents first. Nothing is written through a
    link: a path whose folders between `home` and it are not plain folders is left alone. Returns the
    paths that could not be put back."""
    failed: list[str] = []
    for rel in sorted(found.get("added", []), key=lambda r: r.count("/")):
        path = home / rel
        if not os.path.lexists(path):  # went with a removed folder above it
            continue
        if not _plain_parents(path, home) or not _remove(path):
            failed.append(rel)
    for rel in sorted([*found.get("modified", []), *found.get("removed", [])], key=lambda r: r.count("/")):
        entry, path = kept.get(rel, Kept("lost")), home / rel
        if entry.kind == "lost" or not _plain_parents(path, home) or not _put_back(path, entry):
            failed.append(rel)
    return failed


def _plain_parents(path: Path, home: Path) -> bool:
    """Whether every folder from `home` down to `path`'s parent is a real folder (no link to follow)."""
    try:
        rel = path.parent.relative_to(home)
    except ValueError:
        return False
    here = home
    for part in rel.parts:
        here = here / part
        try:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                return False
        except OSError:
            return False
    return True


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        return True
    except OSError as e:
        log.warning("event=guard_restore_failed path=%s error=%s", path, e)
        return False


def _put_back(path: Path, entry: Kept) -> bool:
    if entry.kind == "dir" and path.is_dir() and not path.is_symlink():
        os.chmod(path, entry.mode)
        return True
    if not _remove(path):
        return False
    try:
        if entry.kind == "dir":
            path.mkdir(mode=entry.mode)
        elif entry.kind == "link":
            os.symlink(entry.data.decode(), path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, entry.mode)
            with os.fdopen(fd, "wb") as f:
                f.write(entry.data)
            os.chmod(path, entry.mode)
        return True
    except OSError as e:
        log.warning("event=guard_restore_failed path=%s error=%s", path, e)
        return False


@dataclass
class ReadOnlyWatch:
    """Hashes and keeps an attempt's read-only paths before it runs; `findings()` after it says what
    changed and puts the originals back, so the grader reads the files the task gave."""

    guard: GuardPolicy | None
    workdir: Path
    home: Path = field(init=False)
    patterns: list[str] = field(init=False)
    before: dict[str, str] = field(init=False)
    kept: dict[str, Kept] = field(init=False)

    def __post_init__(self) -> None:
        self.home = self.workdir / "home"
        self.patterns = list(self.guard.read_only) if self.guard is not None else []
        self.before = snapshot(self.home, self.patterns) if self.patterns else {}
        self.kept = keep(self.home, [r for r in self.before if r != TOO_MANY])

    def findings(self) -> dict[str, Any] | None:
        """The changes to read-only paths (for `details["hacking"]["guard"]`), None when none; the
        changed paths are restored first (any that could not be are listed under `not_restored`)."""
        if not self.patterns:
            return None
        found = changed(self.before, snapshot(self.home, self.patterns))
        if not found:
            return None
        log.warning("event=guard_read_only_changed home=%s changes=%s", self.home, found)
        out: dict[str, Any] = {"read_only_changed": found}
        failed = restore(self.home, self.kept, found)
        if failed:
            log.error("event=guard_not_restored home=%s paths=%s", self.home, failed)
            out["not_restored"] = failed
        return out


OnViolation = Literal["zero", "drop", "flag"]  # as `GuardPolicy.on_violation`


def violation_reward(reward: RewardIn, findings: dict[str, Any], on_violation: OnViolation) -> RewardIn:
    """The reward of a rollout whose guard check found `findings`: flagged under
    `details["hacking"]["guard"]` (beside whatever the grader flagged), and with "zero" or "drop" its
    value 0 (what the grader said kept as `details["guard"]["graded"]`). "drop" also takes the rollout
    out of the batch: the controller marks it failed (`failure="guard"`)."""
    details = dict(reward.details)
    own = details.get("hacking")
    details["hacking"] = {
        **(own if isinstance(own, dict) else {"grader": own} if own else {}),
        "guard": findings,
    }
    details["guard"] = {"on_violation": on_violation, "graded": reward.value}
    value = reward.value if on_violation == "flag" else 0.0
    return reward.model_copy(update={"details": details, "value": value})
