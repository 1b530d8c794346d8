"""The Python API: the same runs as the `harnessrl` command, from a notebook or a script.

    import harnessrl
    summary = harnessrl.train("my_agent/config.yaml", train={"steps": 4}, run_dir="runs/x")
    report = harnessrl.check("my_agent/config.yaml")

Overrides are keyword arguments: a section name with a dict (`train={"steps": 4}`), a top-level key
(`run_dir="runs/x"`), or a dotted key passed through `**{"train.steps": 4}`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from harnessrl.config import RunConfig, load_config


def configure(config_or_path: RunConfig | str | Path | None = None, **overrides: Any) -> RunConfig:
    """A validated `RunConfig` from a path (or a config, or the defaults) and keyword overrides."""
    dotted = [f"{k}={_yaml(v)}" for k, v in overrides.items() if "." in k]
    nested = {k: v for k, v in overrides.items() if "." not in k}
    if isinstance(config_or_path, RunConfig):
        base = config_or_path.model_dump(mode="json")
        return load_config(None, dotted, values={**base, **nested})
    return load_config(config_or_path, dotted, values=nested)


def train(
    config_or_path: RunConfig | str | Path,
    *,
    resume: bool = False,
    fresh: bool = False,
    check: bool = True,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train as `harnessrl train` does and return the run's summary (also in `<run_dir>/summary.json`).

    `resume` continues the run in `run_dir`, `fresh` deletes an earlier run there first (only a
    harnessrl run directory); `check=False` skips the preflight attempt. With `train.algorithm: sft`
    it fine-tunes on `sft.source` instead (`resume` continues it from its newest checkpoint) and returns
    the SFT summary (`sft.json`)."""
    from harnessrl.runs.flow import run

    cfg = configure(config_or_path, **overrides)
    if cfg.train.algorithm == "sft":  # fine-tuning on sft.source: its summary is sft.json's
        from harnessrl.trainer.sft import run_sft

        def sft_step(step: int, total: int, metrics: dict[str, Any]) -> None:
            if on_step is not None:
                on_step(step, metrics)

        return run_sft(cfg, fresh=fresh, resume=resume, on_step=sft_step)
    return run(cfg, fresh=fresh, resume=resume, check=check, on_step=on_step)


def check(config_or_path: RunConfig | str | Path, **overrides: Any) -> Any:
    """Run one graded attempt as `harnessrl check` does; returns its `CheckReport` (`.ok`, `.render()`)."""
    from harnessrl.runs.preflight import run_check

    return run_check(configure(config_or_path, **overrides))


def _yaml(value: Any) -> str:
    import json

    return json.dumps(value)  # JSON is YAML: the override parser reads it back unchanged
