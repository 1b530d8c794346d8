"""Keeping a harness inside its own rollout when it runs as a plain local process (docs/security.md).

The rollout key promises that a harness can do nothing but model calls for its rollout. The sandbox
(`sandbox.py`, the default wherever bubblewrap works) enforces that with namespaces. Without it:
- **as root**, each attempt runs under a uid of its own (`UidSlot`: one per concurrent attempt, from
  the same range and lock files as the sandbox's, so no two attempts ever share one), with no
  supplementary groups. It owns only its `output/` and `home/`; the attempt's folder is readable by
  its group alone, and closed again when the attempt ends. So it cannot read root's 0600 files (the
  store with the key secret, the run's logs), any other attempt's folder, or `/proc/<pid>/environ` of
  the gateway (the admin key) or of another harness (its key): those are another uid's processes.
  Before the harness starts, the uid's leftovers of earlier attempts are killed (`kill(-1)` as that uid).
  A uid that cannot reach the harness's program or the attempt's folder (a Python under a 0700
  `/root`, a run directory under one) cannot run it at all: then the harness runs as root, with a loud
  warning (`event=harness_uid_unavailable`).
- **not root**, nothing is enforced: the harness is the controller's user (`event=harness_isolation_off`).

Whatever the runner, `clean_output` runs after the attempt, once every process of it is gone: the
grader runs outside as the controller's user and must never follow a link the harness planted.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import resource
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

UID_BASE = 2_000_000  # attempt uids are UID_BASE .. UID_BASE + UID_SLOTS - 1 (sandboxed or not)
UID_SLOTS = 4096
LOCK_DIR = os.path.join(tempfile.gettempdir(), "harnessrl-sandbox-uids")
REMOVED_NOTE = "output_removed.txt"  # in the attempt's folder: what clean_output removed, and why

_warned: set[str] = set()


def warn_once(event: str, message: str) -> None:
    """Log `event=<event>` as a warning and print the message to stderr, once per process and message:
    a run that is less isolated than its user may think must say so where they look."""
    key = f"{event}\0{message}"
    if key in _warned:
        return
    _warned.add(key)
    if log.hasHandlers():  # without a handler, logging's last resort would print it to stderr a second time
        log.warning("event=%s message=%r", event, message)
    sys.stderr.write(f"harnessrl: WARNING: {message}\n")


class UidSlot:
    """A uid held by one attempt at a time, across processes, with an flock'ed lock file."""

    def __init__(self, base: int = UID_BASE, slots: int = UID_SLOTS, lock_dir: str = LOCK_DIR) -> None:
        self.base, self.slots, self.lock_dir = base, slots, lock_dir
        self._fd: int | None = None
        self.uid = -1

    def __enter__(self) -> UidSlot:
        os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
        start = random.randrange(self.slots)
        for i in range(self.slots):
            uid = self.base + (start + i) % self.slots
            fd = os.open(os.path.join(self.lock_dir, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fd, self.uid = fd, uid
            return self
        raise OSError(f"all {self.slots} attempt uids are in use")

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock
            self._fd = None


def unreachable(path: str | os.PathLike[str], mode: int = os.R_OK) -> str | None:
    """Why a uid that owns nothing and is in none of the groups of `path` could not read (`os.R_OK`)
    or execute (`os.X_OK`) it — a directory on the way that others cannot search, or the file's own
    mode — or None if it could. Mode bits only (ACLs and mount options are not read)."""
    literal = os.path.abspath(path)
    real = os.path.realpath(literal)
    for p in dict.fromkeys([literal, real]):
        for parent in reversed(Path(p).parents):
            try:
                st = os.stat(parent)
            except OSError as e:
                return f"{parent}: {e.strerror}"
            if not st.st_mode & stat.S_IXOTH:
                return f"{parent} is not searchable by other users (mode {stat.filemode(st.st_mode)})"
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{real}: {e.strerror}"
    bit = stat.S_IXOTH if mode == os.X_OK else stat.S_IROTH
    if not st.st_mode & bit:
        return f"{real} is not {'executable' if mode == os.X_OK else 'readable'} by other users"
    return None


def command_unreachable(command: list[str], env: dict[str, str]) -> str | None:
    """Why an unprivileged uid could not run `command` (its program, and the absolute paths of files in
    its arguments), or None. A program not found at all is left to fail at start as usual."""
    program = command[0] if "/" in command[0] else shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        return None
    why = unreachable(program, os.X_OK)
    for arg in command[1:]:
        if why is None and arg.startswith("/") and os.path.isfile(arg):
            why = unreachable(arg, os.R_OK)
    return why


def open_traverse(workdir: Path) -> None:
    """Let others search (never list) the rollout's folder and the folder of rollouts above the attempt's
    folder when this process made them without that bit (`o+x` only; nothing is taken away)."""
    for d in (workdir.parent, workdir.parent.parent):
        with contextlib.suppress(OSError):
            st = os.stat(d)
            if st.st_uid == os.geteuid() and not st.st_mode & stat.S_IXOTH:
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)


def protect_run_dir(run_dir: Path) -> None:
    """Close a run directory to every other user except the path to the attempts' folders: the
    directory and `rollouts/` become 0711 (searchable, not listable), everything else in it (the store
    with the key secret, logs, tasks with their references, checkpoints) and the files in `rollouts/`
    lose all group and other access. For files made later, run under umask 077 (docs/security.md)."""
    rollouts = run_dir / "rollouts"
    rollouts.mkdir(parents=True, exist_ok=True)
    for d in (run_dir, rollouts):
        os.chmod(d, 0o711)
    for entry in [
        *os.scandir(run_dir),
        *(e for e in os.scandir(rollouts) if not e.is_dir(follow_symlinks=False)),
    ]:
        if entry.path != str(rollouts) and not entry.is_symlink():
            os.chmod(entry.path, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) & 0o700)


def give_attempt_dirs(workdir: Path, uid: int) -> Path:
    """Hand an attempt's folder to its uid: the folder itself stays root's, readable by the uid's group
    only (0750, so `task.json`, `stdout.txt`, `runner.json` cannot be swapped for links); `output/`
    and `home/` (with the `harness.files` copied there) become the uid's (0700). Returns `home/`."""
    home = workdir / "home"
    home.mkdir(exist_ok=True)
    os.chown(workdir, 0, uid)
    os.chmod(workdir, 0o750)
    for d in (workdir / "output", home):
        give_tree(d, uid)
        os.chmod(d, 0o700)
    return home


def give_tree(root: Path, uid: int) -> None:
    """Make `root` and everything under it (links themselves, never their targets) owned by `uid`."""
    os.lchown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def close_attempt_dir(workdir: Path) -> None:
    """After the attempt: the folder is root's alone again, so the next attempt to get this uid cannot
    read what this one left in `output/` or `home/`."""
    with contextlib.suppress(OSError):
        os.chown(workdir, 0, 0)
        os.chmod(workdir, 0o700)


def drop_to(uid: int, max_processes: int | None = None) -> None:
    """In a child, as root: become `uid` (gid `uid`, no supplementary groups) and kill every process
    that uid still has (what an earlier attempt left, e.g. a daemon that escaped its process group;
    `kill(-1)` signals every process this one may, the caller excepted)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    if max_processes is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))


def kill_uid(uid: int, passes: int = 3) -> int:
    """SIGKILL the processes of `uid` that /proc shows as its own (a harness's daemon outliving its
    process group); returns how many. Best effort: a process that made itself undumpable shows as
    root's here, and is killed by `drop_to` before the uid runs anything again."""
    killed = 0
    for _ in range(passes):
        found = 0
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        os.kill(int(name), signal.SIGKILL)
                        found += 1
        killed += found
        if not found:
            break
    return killed


def seal(root: Path) -> None:
    """Make every directory under `root` root's and 0755, so a process of the attempt that is still
    alive (holding a descriptor of one) can add, rename or remove nothing there any more."""
    for dirpath, _, _ in os.walk(root):
        with contextlib.suppress(OSError):
            os.lchown(dirpath, 0, 0)
            os.chmod(dirpath, 0o755, follow_symlinks=False)


def finish_attempt(workdir: Path, uid: int | None, rollout_id: str, attempt: int) -> str:
    """After the attempt's process group was killed: kill what its uid still runs, seal and clean its
    `output/`, close its folder; returns the note for its stderr tail ("" if nothing was removed)."""
    output_dir = workdir / "output"
    if uid is not None:
        kill_uid(uid)
        seal(output_dir)
    note = record_removed(workdir, clean_output(output_dir), rollout_id, attempt)
    if uid is not None:
        close_attempt_dir(workdir)
    return note


def clean_output(output_dir: Path) -> list[str]:
    """Remove from `output/` whatever could make a reader outside follow the harness somewhere else:
    symlinks, FIFOs, sockets and devices, and regular files with hard links outside `output/`.
    Returns one line per removal (`<relative path>: <why>`). Runs once the attempt's processes are gone."""
    removed: list[str] = []
    files: dict[tuple[int, int], list[tuple[str, int]]] = {}  # inode -> (path, st_nlink) seen here
    for dirpath, dirnames, filenames in os.walk(output_dir):  # never descends into linked directories
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            why = _why_removed(st)
            if why is None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                files.setdefault((st.st_dev, st.st_ino), []).append((path, st.st_nlink))
            elif why is not None:
                _remove(path, why, output_dir, removed)
    for links in files.values():
        if len(links) < links[0][1]:  # some of its names are elsewhere
            for path, nlink in links:
                _remove(path, f"hard link ({nlink} names, {nlink - len(links)} outside output/)", output_dir, removed)  # fmt: skip
    return removed


def _why_removed(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return "not a regular file or directory (FIFO, socket or device)"


def _remove(path: str, why: str, root: Path, removed: list[str]) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        why += f"; could not remove: {e.strerror}"
    removed.append(f"{os.path.relpath(path, root)}: {why}")


def record_removed(workdir: Path, removed: list[str], rollout_id: str, attempt: int) -> str:
    """Log what `clean_output` removed and write it to `<workdir>/output_removed.txt` (never through a
    link); returns a line for the attempt's stderr tail ("" when nothing was removed)."""
    if not removed:
        return ""
    log.warning("event=output_links_removed rollout=%s attempt=%d n=%d what=%r",
                rollout_id, attempt, len(removed), removed[:20])  # fmt: skip
    note = workdir / REMOVED_NOTE
    with contextlib.suppress(OSError):
        if note.is_symlink():
            note.unlink()
        fd = os.open(note, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write("".join(line + "\n" for line in removed))
    links = sum(line.endswith(": symlink") for line in removed)
    return (f"\n[harnessrl] removed {links} symlink(s) and {len(removed) - links} other link(s) or special "
            f"file(s) from the output directory (see {REMOVED_NOTE})\n")  # fmt: skip


class IsolationError(RuntimeError):
    """A harness was required to run under a uid of its own (`own_uid="required"`) and cannot."""


def attempt_identity(setting: str, workdir: Path, command: list[str], env: dict[str, str], own_env: dict[str, str],
                     stack: contextlib.ExitStack) -> tuple[int | None, Path]:  # fmt: skip
    """The uid an attempt runs as (`attempt_uid`) and its working folder, the attempt's `home/` in
    every case (with a uid of its own, handed to that uid, and `HOME` pointed there unless the harness
    sets its own in `own_env`). Raises `IsolationError`/`OSError` as `attempt_uid` does."""
    uid = attempt_uid(setting, workdir, command, env, stack)
    if uid is None:
        home = workdir / "home"
        home.mkdir(exist_ok=True)
        return None, home
    cwd = give_attempt_dirs(workdir, uid)
    if "HOME" not in own_env:
        env["HOME"] = str(cwd)
    return uid, cwd


def attempt_uid(setting: str, workdir: Path, command: list[str], env: dict[str, str],
                stack: contextlib.ExitStack) -> int | None:  # fmt: skip
    """The uid an attempt's harness runs as, held in `stack` until the attempt ends, or None to run it
    as this process's user. `setting`: "auto" (a uid of its own as root when that uid can reach the
    program and the attempt's folder; otherwise a loud warning), "required" (otherwise
    `IsolationError`), "never"."""
    if setting == "never":
        return None
    if os.geteuid() != 0:
        if setting == "required":
            raise IsolationError("a uid of its own for the harness needs harnessrl to run as root")
        warn_once("harness_isolation_off", "harnesses run unsandboxed as your own user: the rollout keys "
                  "are not enforced against them (a harness can read the store and its key secret, the "
                  "gateway's admin key in /proc, other rollouts' folders). Use controller.sandbox=auto "
                  "or true where bubblewrap works; see docs/security.md")  # fmt: skip
        return None
    open_traverse(workdir)
    why = unreachable(workdir.parent, os.X_OK) or command_unreachable(command, env)
    if why is not None:
        if setting == "required":
            raise IsolationError(f"the harness cannot run under a uid of its own: {why}")
        warn_once("harness_uid_unavailable", f"harnesses run as root, not under a uid of their own, so "
                  f"the rollout keys are not enforced against them: {why}. Use the sandbox "
                  "(controller.sandbox=auto or true), or put Python and the run directory where other "
                  "users can reach them; see docs/security.md")  # fmt: skip
        return None
    return stack.enter_context(UidSlot()).uid
