"""Whether the sandbox's filesystem view shows what a harness needs to start, checked before a run.

The sandbox shows the system directories, harnessrl's own Python and package, the attempt's folder
and `controller.sandbox_ro_paths` (`sandbox.view_paths`). A harness that lives elsewhere on the machine
— its own virtualenv, a Python installed under `/opt` or a home directory, a console script whose
`#!` line names such an interpreter — would start in the sandbox and die on a missing file, once per
attempt. `unseen_by_sandbox` finds that before the run: the first host path the harness's program
needs that the view does not show, with the setting that exposes it. It reads mode-free facts only
(paths, `pyvenv.cfg`, `#!` lines); a program not found at all is left to fail at start as usual.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harnessrl.controller.runners.sandbox import SandboxSpec, view_paths


def _shebang(path: str, path_env: str | None) -> str | None:
    """The interpreter a `#!` line names (`/usr/bin/env NAME` looked up on `path_env`), or None for a
    binary or no such line."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
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
    needs = [(os.path.realpath(program), f"the harness's program {command[0]}")]
    interpreter = _shebang(program, path_env)
    if interpreter is not None:
        needs.append((os.path.realpath(interpreter), f"the interpreter on the #! line of {program}"))
        program = interpreter
    if _is_python(program):
        needs += _python_homes(program)
    return needs


def unseen_by_sandbox(command: list[str], path_env: str | None, sandbox: SandboxSpec) -> str | None:
    """Why the sandbox cannot start `command` (the first needed host path its view does not show, and
    the setting that exposes it), or None when it shows all of them."""
    view = [*view_paths(sandbox), *sandbox.rw_paths]
    roots = {os.path.abspath(v) for v in view} | {os.path.realpath(v) for v in view if os.path.exists(v)}
    absolute = {a for a in command if a.startswith("/") and os.path.isfile(a)}  # bound one by one
    for path, why in needed_paths(command, path_env):
        if path in absolute or any(_under(path, r) for r in roots):
            continue
        return (f"the sandbox does not show {path} ({why}); add it to controller.sandbox_ro_paths "
                f"(read-only in every attempt), or choose controller.sandbox=false (docs/security.md)")  # fmt: skip
    return None


def _under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")
