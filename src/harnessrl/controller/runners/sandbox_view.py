"""What a sandboxed attempt sees of the host, decided in this one place for every sandboxed runner:
the exec sandbox (`sandbox.bwrap_args`) and the fork server (the zygote's sandbox from the same
`bwrap_args`, each forked attempt's fresh `/tmp` with the view's paths under it bound again: `kept`).

`attempt_view` gives, read-only:
- the system directories (`SandboxSpec.system_paths`), harnessrl's own Python and package;
- what the harness's program needs to start (`needed_paths`): its file; for a Python its virtualenv
  and that venv's base installation (or the installation its real file lives in); for a `#!` script
  its interpreter the same way. A harness in a virtualenv of its own needs no setting;
- the harness script's own folder (where `python harness.py` looks for `import helpers`, a package
  beside it, its data), unless that is a folder right under `/` (`/tmp`, `/root`) or, as root, one
  the attempt's uid cannot pass (0700): then the files the command names only;
- `controller.sandbox_ro_paths`.
Read-write: `SandboxSpec.rw_paths`. Every path is shown as written and, where a symlinked folder leads
to it, at its real path too. A run's folder (the store with the key secret, other attempts' folders)
that lies inside a shown folder gets an empty tmpfs over it (`covered`; its `rollouts/` when the run's
folder is the shown one); the attempt's own folder is bound on top. Paths are host paths; a space or any letters in them are fine.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harnessrl.controller.isolation import unreachable

PACKAGE_DIR = Path(__file__).resolve().parents[2]  # src/harnessrl: harnesses may import it
FRESH = ("/tmp", "/dev/shm")  # empty and private in every attempt (a fork server's attempt too)


class SandboxPaths(Protocol):
    """The fields of `sandbox.SandboxSpec` the view reads (a protocol, so this module does not import
    sandbox.py, which imports it)."""

    @property
    def system_paths(self) -> tuple[str, ...]: ...
    @property
    def ro_paths(self) -> tuple[str, ...]: ...
    @property
    def rw_paths(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class AttemptView:
    """The host paths an attempt sees: read-only, read-write, and run folders covered by a tmpfs."""

    ro: tuple[str, ...]
    rw: tuple[str, ...]
    covered: tuple[str, ...]

    def kept(self, under: list[str]) -> list[list[str]]:
        """`[path, "ro"|"rw"]` for the view's paths that a tmpfs over one of `under` would hide (a fork
        server's attempt binds them again after mounting its fresh `/tmp`)."""
        out = [[p, "ro"] for p in self.ro] + [[p, "rw"] for p in self.rw]
        return [k for k in out if any(_under(k[0], u) for u in under)]


def view_paths(sandbox: SandboxPaths) -> list[str]:
    """Host paths every attempt sees read-only: system dirs, Python, this package, the extras."""
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}  # fmt: skip
    return [*sandbox.system_paths, *sorted(python), str(PACKAGE_DIR), *sandbox.ro_paths]


def attempt_view(
    sandbox: SandboxPaths, command: list[str], path_env: str | None, rollouts: Path
) -> AttemptView:
    """The view of an attempt of `command` whose folder is under `rollouts` (the run's attempts folder)."""
    ro = [*view_paths(sandbox), *(p for p, _ in needed_paths(command, path_env)), *harness_folders(command)]
    ro = _outermost(_both_forms(ro))
    rw = _both_forms(list(sandbox.rw_paths))
    covered: list[str] = []
    for folder in (rollouts.parent, rollouts):  # the run's folder, else (a shown folder) its attempts'
        inside = [f for f in _both_forms([str(folder)]) if any(_under(f, v) and v != f for v in ro + rw)]
        covered += [f for f in inside if not any(_under(f, c) for c in covered)]
    return AttemptView(tuple(ro), tuple(rw), tuple(covered))


def harness_folders(command: list[str]) -> list[str]:
    """The absolute files `command` names, and the folder of its script (the first of them after the
    program, or a `#!` program itself) unless that folder is right under `/`."""
    files = [a for a in command[1:] if a.startswith("/") and os.path.isfile(a)]
    script = files[0] if files else (command[0] if _shebang(command[0], None) else None)
    out = list(files)
    folder = str(Path(script).parent) if script is not None else "/"
    # as root the harness runs as a uid of its own, which must be able to pass the folder (a 0700 one,
    # e.g. pytest's tmp_path, would also bar it from the attempt's folder below: then files only)
    reachable = os.geteuid() != 0 or unreachable(folder, os.X_OK) is None
    if len(Path(folder).parts) > 2 and reachable:
        out.append(folder)
    return out


def _both_forms(paths: list[str]) -> list[str]:
    """Each path as written (absolute) and, if a link leads to it, at its real path; in order, once."""
    out: list[str] = []
    for p in paths:
        a = os.path.abspath(p)
        out.append(a)
        if os.path.exists(a) and os.path.dirname(a) != "/":  # (/bin -> usr/bin: a link in the view)
            out.append(os.path.realpath(a))
    return list(dict.fromkeys(out))


def _outermost(paths: list[str]) -> list[str]:
    """`paths` without those inside another of them (already shown by it; binding one again could
    meet a link there whose target is not mounted yet)."""
    return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


def _shebang(path: str, path_env: str | None) -> str | None:
    """The interpreter a `#!` line names (`/usr/bin/env NAME` looked up on `path_env`; the PYTHON of
    pip's `#!/bin/sh` + `'''exec' "PYTHON"` form for a path with spaces), or None for a binary or
    no such line."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    lines = head.decode(errors="replace").splitlines()
    pip = re.match(r"'''exec' \"([^\"]+)\" ", lines[1] if len(lines) > 1 else "")
    if pip is not None and os.path.isabs(pip.group(1)):
        return pip.group(1)
    words = lines[0][2:].split()
    if len(words) >= 2 and os.path.basename(words[0]) == "env":
        return shutil.which(words[1], path=path_env)
    return words[0] if words and os.path.isabs(words[0]) else None


def _python_homes(program: str) -> list[tuple[str, str]]:
    """(path, why) the interpreter `program` needs: its virtualenv and that venv's base installation,
    or the installation its real file lives in (the standard library is under its prefix)."""
    needs: list[tuple[str, str]] = []
    venv = Path(program).parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        needs.append((str(venv), f"the virtualenv of {program}"))
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                base = os.path.dirname(value.strip().rstrip("/"))
                needs.append((base, f"the Python installation {program}'s virtualenv is made from"))
    else:
        real = os.path.realpath(program)
        needs.append((os.path.dirname(os.path.dirname(real)), f"the Python installation of {real}"))
    return needs


def _is_python(path: str) -> bool:
    name = os.path.basename(os.path.realpath(path))
    return name.startswith("python") or name.startswith("pypy")


def needed_paths(command: list[str], path_env: str | None) -> list[tuple[str, str]]:
    """Host paths (with why) the harness `command` needs to start: its program, for a Python its
    installation and virtualenv, for a `#!` script its interpreter's the same way."""
    program = command[0] if "/" in command[0] else shutil.which(command[0], path=path_env)
    if program is None:
        return []
    needs = [(os.path.abspath(program), f"the harness's program {command[0]}")]
    needs.append((os.path.realpath(program), f"the real file of {command[0]}"))
    interpreter = _shebang(program, path_env)
    if interpreter is not None:
        needs.append((os.path.realpath(interpreter), f"the interpreter on the #! line of {program}"))
        program = interpreter
    if _is_python(program):
        needs += _python_homes(program)
    return needs


def _under(path: str, root: str) -> bool:
    """Whether `path` is `root` or inside it (both taken as absolute, not resolved)."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")
