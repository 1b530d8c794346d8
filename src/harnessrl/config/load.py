"""Loading a run configuration: YAML files plus dotted overrides (`train.lr=2e-5`), errors that name
the key, and the config's file references resolved against its folder."""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from harnessrl.config.sections import RunConfig
from harnessrl.errors import ConfigError


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override (value parsed as YAML) to a nested dict in place."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' must look like section.key=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{k}' is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{override}': the value is not valid YAML: {e}") from e


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
) -> RunConfig:
    """Read a YAML config (or the defaults), merge `values` (nested sections) and apply dotted
    overrides; relative paths in harness, tasks and grader are resolved against the config's folder
    (the current folder without a file). Every problem is reported at once in one `ConfigError`."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping of sections")
        data, base = loaded, path.resolve().parent
        data.setdefault("name", base.name)
    _deep_merge(data, values or {})
    for o in overrides or []:
        apply_override(data, o)
    if "example" in data:
        raise ConfigError(
            f"'example: {data['example']}' is no longer a config key: declare harness, tasks and grader "
            "(docs/config.md), or start from a built-in config, e.g. "
            "`harnessrl train --config src/harnessrl/examples/calc/config.yaml`"
        )
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from e
    problems = resolve_paths(cfg, base)
    if problems:
        raise ConfigError("\n".join(["config errors:", *(f"  {p}" for p in problems)]))
    return cfg


def _deep_merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


def format_errors(e: ValidationError) -> str:
    """All validation errors, one line each, with "did you mean" for misspelt keys."""
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        where = ".".join(loc) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(loc)
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}" + (f" (got {err['input']!r})" if _show_input(err) else ""))
    if len(lines) == 1:
        return f"config error at '{lines[0].strip().split(': ', 1)[0]}': {lines[0].split(': ', 1)[1]}"
    return "\n".join([f"{len(lines)} config errors:", *lines])


def _show_input(err: Any) -> bool:
    return err["type"] not in ("extra_forbidden", "missing", "value_error") and not isinstance(
        err.get("input"), dict
    )


def _did_you_mean(loc: list[str]) -> str:
    model: Any = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        model = getattr(field, "annotation", None) if field else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(model.model_fields)}"


# names `harnessrl.modeling.loading.resolve_model` knows (plus variants)
KNOWN_MODELS = ("smollm2", "gemma3-270m")


def resolve_paths(cfg: RunConfig, base: Path) -> list[str]:
    """Make the config's file references absolute (against `base`) and check that they exist;
    returns the problems found (empty: all good)."""
    problems: list[str] = []
    h = cfg.harness
    if h.command:
        h.command = resolve_command(h.command, base)
        if shutil.which(h.command[0]) is None and not Path(h.command[0]).is_file():
            problems.append(f"harness.command: program {h.command[0]!r} not found (PATH or {base})")
        problems += [
            f"harness.command: file {a} not found" for a in h.command[1:] if _missing_script(a, base)
        ]
    files = []
    for f in h.files:
        p = _absolute(f, base)
        if not p.exists():
            problems.append(f"harness.files: {p} not found")
        files.append(str(p))
    h.files = files
    t = cfg.tasks
    for key in ("train", "heldout"):
        value = getattr(t, key)
        if value is not None:
            p = _absolute(value, base)
            setattr(t, key, str(p))
            if not p.is_file():
                problems.append(f"tasks.{key}: {p} not found")
    g = cfg.grader
    if g.command:
        g.command = resolve_command(g.command, base)
    if g.judge is not None and g.judge.rubric_file:
        rubric = _absolute(g.judge.rubric_file, base)
        g.judge.rubric_file = str(rubric)
        if not rubric.is_file():
            problems.append(f"grader.judge.rubric_file: {rubric} not found")
    if not cfg.config_dir:
        cfg.config_dir = str(base)
    m = cfg.engine.model
    if not m.startswith(KNOWN_MODELS) and _absolute(m, base).is_dir():
        cfg.engine.model = str(_absolute(m, base))
    return problems


def check_model(cfg: RunConfig) -> None:
    """Raise `ConfigError` unless `engine.model` is a packaged model name or an existing folder (checked
    when a run starts, not at load: a GPU cluster's config may name a folder this machine lacks)."""
    m = cfg.engine.model
    if not m.startswith(KNOWN_MODELS) and not Path(m).is_dir():
        raise ConfigError(
            f"engine.model: {m!r} is neither a model folder nor one of {', '.join(KNOWN_MODELS)}"
        )


def resolve_command(command: list[str], base: Path) -> list[str]:
    """`python`/`python3` → this interpreter; arguments naming a file or folder under `base` →
    absolute paths (so an attempt, running in its own folder, finds them), links not followed (a
    virtualenv's `venv/bin/python` is a link to its base interpreter: followed, it would lose the venv)."""
    out = list(command)
    if out[0] in ("python", "python3"):
        out[0] = sys.executable
    for i, a in enumerate(out):
        if not a.startswith("-") and not Path(a).is_absolute() and (base / a).exists():
            out[i] = os.path.abspath(base / a)
    return out


def _missing_script(arg: str, base: Path) -> bool:
    """A relative argument that looks like a script file (x.py, x.js, x.sh, ./x) and does not exist."""
    if arg.startswith("-") or Path(arg).is_absolute():
        return not arg.startswith("-") and arg.endswith(_SCRIPT_SUFFIXES) and not Path(arg).exists()
    return (arg.endswith(_SCRIPT_SUFFIXES) or arg.startswith("./")) and not (base / arg).exists()


_SCRIPT_SUFFIXES = (".py", ".js", ".mjs", ".ts", ".sh")


def _absolute(p: str, base: Path) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else (base / path).resolve()
