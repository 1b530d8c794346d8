"""harnessrl: harnessed agentic RL — train the model behind an unmodified agent harness.

`harnessrl.train(config, **overrides)` and `harnessrl.check(config)` are the Python API (api.py);
importing this package loads nothing heavy (torch is imported only when a run starts).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "check", "configure", "train"]


def train(config_or_path: Any, **kwargs: Any) -> dict[str, Any]:
    """Train a run from a config (a path or a `RunConfig`) with keyword overrides; returns its summary."""
    from harnessrl.api import train as _train

    return _train(config_or_path, **kwargs)


def check(config_or_path: Any, **overrides: Any) -> Any:
    """One graded attempt of the config's harness before training; returns a `CheckReport`."""
    from harnessrl.api import check as _check

    return _check(config_or_path, **overrides)


def configure(config_or_path: Any = None, **overrides: Any) -> Any:
    """A validated `RunConfig` from a path and keyword overrides (`harnessrl.config` is the module)."""
    from harnessrl.api import configure as _configure

    return _configure(config_or_path, **overrides)
