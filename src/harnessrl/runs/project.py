"""What a config declares, made runnable: the harness command, the task splits and the grader.

Every run goes through here — a user's project and the built-in examples alike (their configs use the
same `harness`, `tasks` and `grader` keys; see docs/config.md). Nothing here starts a process.
"""

from __future__ import annotations

import importlib
import json
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harnessrl.config import ConfigError, RunConfig
from harnessrl.controller.grader import CommandGrader, Grader
from harnessrl.controller.judge import judge_from_config
from harnessrl.controller.runner import HarnessSpec
from harnessrl.schema import Task

log = logging.getLogger(__name__)

Splits = Callable[[int, int, int], tuple[list[Task], list[Task]]]  # (n_train, n_heldout, seed)
DEFAULT_GENERATED = 1000  # training tasks a generator makes when data.n_train is not set


@dataclass(frozen=True)
class Project:
    """A run's harness, task source and grader, resolved from its config."""

    name: str
    harness_command: list[str]
    grader: Grader
    build_splits: Splits
    harness_env: dict[str, str] = field(default_factory=dict)
    harness_files: tuple[Path, ...] = ()
    config_path: Path | None = None

    def harness_spec(self, timeout_s: float) -> HarnessSpec:
        """The controller's view of the harness."""
        return HarnessSpec(
            command=self.harness_command,
            timeout_s=timeout_s,
            env=dict(self.harness_env),
            files=self.harness_files,
        )

    def splits(self, cfg: RunConfig) -> tuple[list[Task], list[Task]]:
        """The run's train and held-out tasks under its `data` and `eval` settings."""
        n_train = cfg.data.n_train if cfg.data.n_train is not None else -1
        return self.build_splits(n_train, cfg.eval.n_heldout, cfg.data.seed)


def resolve_project(cfg: RunConfig, config_path: Path | None = None) -> Project:
    """The project `cfg` declares; a `ConfigError` lists everything missing or unloadable."""
    missing = cfg.missing()
    if missing:
        raise ConfigError("\n".join(["the config does not say how to run:", *(f"  {m}" for m in missing)]))
    assert cfg.harness.command is not None
    grader: Grader
    if cfg.grader.python:
        grader = _as_grader(load_target(cfg.grader.python, cfg.config_dir, "grader.python"))
    elif cfg.grader.judge is not None:
        grader = judge_from_config(cfg.grader.judge, cfg.controller.grader_timeout_s)
    else:
        assert cfg.grader.command is not None
        grader = CommandGrader(cfg.grader.command, cfg.controller.grader_timeout_s, dict(cfg.grader.env))
    build: Splits
    if cfg.tasks.generator:
        generator = load_target(cfg.tasks.generator, cfg.config_dir, "tasks.generator")
        build = _generated(generator, cfg.tasks.generator)
    else:
        build = _from_files(cfg)
    return Project(
        name=cfg.name or "run",
        harness_command=list(cfg.harness.command),
        grader=grader,
        build_splits=build,
        harness_env=dict(cfg.harness.env),
        harness_files=tuple(Path(f) for f in cfg.harness.files),
        config_path=config_path,
    )


def load_target(target: str, config_dir: str, key: str) -> Any:
    """Import `module:attribute`, looking in `config_dir` first (a grader.py next to the config)."""
    module_name, _, attr = target.partition(":")
    if config_dir and config_dir not in sys.path:
        sys.path.insert(0, config_dir)
    _forget_if_elsewhere(module_name, config_dir)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}: cannot import {module_name!r} ({e}); looked in {config_dir} and sys.path"
        ) from e
    except Exception as e:  # the user's module raised while importing
        raise ConfigError(f"{key}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ConfigError(
            f"{key}: {module_name!r} has no {attr!r}; it has: {', '.join(public) or 'nothing callable'}"
        )
    value = getattr(module, attr)
    if not callable(value):
        raise ConfigError(f"{key}: {target} is not a function")
    return value


def _forget_if_elsewhere(module_name: str, config_dir: str) -> None:
    """Two projects in one process may both have a `grader.py`: a cached module of that name from
    another folder is dropped so this config's own file is imported."""
    if not config_dir:
        return
    local = Path(config_dir, *module_name.split("."))
    cached = sys.modules.get(module_name)
    if cached is None or not (local.with_suffix(".py").is_file() or (local / "__init__.py").is_file()):
        return
    if not str(getattr(cached, "__file__", "")).startswith(str(local)):
        del sys.modules[module_name]


def _as_grader(fn: Callable[..., Any]) -> Grader:
    return fn  # type: ignore[no-any-return]  # any (task, result) -> float | (float, details) | RewardIn


def _generated(generator: Callable[..., Any], target: str) -> Splits:
    def build(n_train: int, n_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
        n = DEFAULT_GENERATED if n_train < 0 else n_train
        out = generator(n, n_heldout, seed)
        try:
            train, heldout = out
            return [Task.model_validate(t) for t in train], [Task.model_validate(t) for t in heldout]
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"tasks.generator {target} must return (train, heldout) lists of tasks: {e}"
            ) from e

    return build


def _from_files(cfg: RunConfig) -> Splits:
    t = cfg.tasks
    assert t.train is not None
    train_path, heldout_path, fraction = Path(t.train), t.heldout, t.heldout_fraction

    def build(n_train: int, n_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
        train = read_tasks(train_path)
        if heldout_path is not None:
            heldout = read_tasks(Path(heldout_path))
        elif fraction is not None:
            train, heldout = split_heldout(train, fraction, seed)
        else:
            heldout = []
        heldout = disjoint(train, heldout)[:n_heldout]
        return (train if n_train < 0 else train[:n_train]), heldout

    return build


def read_tasks(path: Path) -> list[Task]:
    """Tasks from a JSONL file (one object a line: task_id, input, reference, ...) or a Parquet file;
    a line without `task_id` gets `<file stem>-<line>`. Errors name the file and line."""
    if path.suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: not a JSON object: {e}") from e
    tasks, seen = [], set()
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{i}: a task must be a JSON object, not {type(row).__name__}")
        row.setdefault("task_id", f"{path.stem}-{i}")
        row["task_id"] = str(row["task_id"])
        try:
            task = Task.model_validate(row)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{path}:{i}: task field '{where}': {first['msg']}") from e
        if task.task_id in seen:
            raise ConfigError(f"{path}:{i}: task_id {task.task_id!r} appears twice")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"{path}: no tasks in the file")
    return tasks


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from e
    return list(pq.read_table(path).to_pylist())


def split_heldout(tasks: list[Task], fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """A seeded split: `fraction` of the distinct task inputs held out, the rest kept for training."""
    keys = sorted({_key(t) for t in tasks})
    random.Random(seed).shuffle(keys)
    held = set(keys[: max(1, round(len(keys) * fraction))])
    if len(held) == len(keys):
        raise ConfigError("tasks.heldout_fraction leaves no training task; use a smaller fraction")
    return [t for t in tasks if _key(t) not in held], [t for t in tasks if _key(t) in held]


def disjoint(train: list[Task], heldout: list[Task]) -> list[Task]:
    """Held-out tasks whose input also appears in train are dropped (logged): evaluation measures
    what the model learned, not what it saw."""
    seen = {_key(t) for t in train}
    kept = [t for t in heldout if _key(t) not in seen]
    if len(kept) < len(heldout):
        log.warning("event=heldout_overlap dropped=%d kept=%d", len(heldout) - len(kept), len(kept))
    return kept


def _key(task: Task) -> str:
    return json.dumps(task.input, sort_keys=True)
