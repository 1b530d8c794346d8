"""Run directories: created, resumed or replaced only when that is safe, never anything else deleted.

A run directory is marked by `run.json` (its run id). `--fresh` deletes only a marked directory;
starting into a directory that holds a run asks for `--resume` or `--fresh`; resuming with a config
that differs in anything but the settings that may change between sessions refuses and lists the
differences.
"""

from __future__ import annotations

import json
import secrets
import shutil
from enum import StrEnum
from pathlib import Path
from typing import Any

from harnessrl.config import RunConfig

MARKER = "run.json"

# Settings that may differ when a run is resumed: how long it runs and how it runs on this machine,
# not what it learns from or how.
RESUMABLE = (
    "train.steps",
    "train.time_budget_s",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.threads",
    "eval.every",
    "engine.port",
    "engine.threads",
    "engine.url",
    "gateway.port",
    "controller.",
    "config_dir",
    "name",
)


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked; the message says what to do instead."""


class Mode(StrEnum):
    """How to treat an existing run directory."""

    NEW = "new"  # it must not hold a run yet
    FRESH = "fresh"  # an earlier run there is deleted (only a marked run directory)
    RESUME = "resume"  # continue the run there (or start one if there is none)
    REPLACE = "replace"  # the demo: an earlier run there is moved to `<dir>.previous`, and said so


def is_run_dir(path: Path) -> bool:
    """True when `path` holds a harnessrl run (its marker file)."""
    return (path / MARKER).is_file()


def prepare(run_dir: Path, cfg: RunConfig, mode: Mode) -> list[str]:
    """Make `run_dir` ready for `cfg` under `mode`; returns notices for the user (e.g. what was
    moved aside). Raises `RunDirError` instead of touching anything it should not."""
    notices: list[str] = []
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir {run_dir} is a file, not a directory")
    holds_run = is_run_dir(run_dir)
    nonempty = run_dir.is_dir() and any(run_dir.iterdir())
    if nonempty and not holds_run:
        raise RunDirError(
            f"run_dir {run_dir} is not empty and holds no harnessrl run (no {MARKER}); nothing was "
            "changed. Choose another run_dir (run_dir=runs/NAME) or empty it yourself."
        )
    if holds_run and mode == Mode.NEW:
        diff = config_diff(_saved_config(run_dir), cfg)
        what = f"a run with a different config:\n{_lines(diff)}" if diff else "a run of this config"
        raise RunDirError(
            f"run_dir {run_dir} already holds {what}\nPass --resume to continue it, --fresh to delete "
            "it, or choose another run_dir (run_dir=runs/NAME)."
        )
    if holds_run and mode == Mode.RESUME:
        diff = [d for d in config_diff(_saved_config(run_dir), cfg) if not d.startswith(RESUMABLE)]
        if diff:
            raise RunDirError(
                f"cannot resume {run_dir} with a different config:\n{_lines(diff)}\n"
                "Only these may change on resume: "
                + ", ".join(k + "*" if k.endswith(".") else k for k in RESUMABLE)
            )
    if holds_run and mode == Mode.FRESH:
        shutil.rmtree(run_dir)
        notices.append(f"deleted the earlier run in {run_dir} (--fresh)")
    if holds_run and mode == Mode.REPLACE:
        previous = run_dir.with_name(run_dir.name + ".previous")
        if is_run_dir(previous):
            shutil.rmtree(previous)
        if previous.exists():
            raise RunDirError(f"cannot move the earlier run aside: {previous} exists and is not a run")
        run_dir.rename(previous)
        notices.append(
            f"moved the earlier run in {run_dir} to {previous} (use --resume to continue it instead)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_run_dir(run_dir):
        (run_dir / MARKER).write_text(
            json.dumps({"run_id": "run" + secrets.token_hex(4), "harnessrl_run": 1})
        )
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return notices


def run_id(run_dir: Path) -> str:
    """The run's stable id: rollout client ids derive from it, so a resumed run reuses work."""
    return str(json.loads((run_dir / MARKER).read_text())["run_id"])


def _saved_config(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def config_diff(old: dict[str, Any], new: RunConfig) -> list[str]:
    """`key: old -> new` for every setting that differs (run_dir aside), dotted keys, sorted."""
    if not old:
        return []
    a, b = _flatten(old), _flatten(new.model_dump(mode="json"))
    keys = sorted((set(a) | set(b)) - {"run_dir"})
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in keys if a.get(k) != b.get(k)]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("env", "ray_resources"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _lines(diff: list[str]) -> str:
    return "\n".join(f"  {d}" for d in diff)
