"""Typed run configuration: YAML files plus dotted overrides (`train.lr=2e-5`).

`sections`: every key, its default and its check (`RunConfig` and its sections); `load`: reading files
and overrides into a `RunConfig`, error messages that name the key, file references resolved;
`doc`: docs/config.md generated from `sections`.
"""

from __future__ import annotations

from harnessrl.config.load import (
    KNOWN_MODELS,
    apply_override,
    check_model,
    format_errors,
    load_config,
    resolve_command,
    resolve_paths,
)
from harnessrl.config.project import (
    RESERVED_ENV,
    GraderSection,
    HarnessSection,
    JudgeSection,
    TasksSection,
)
from harnessrl.config.sections import (
    ControllerSection,
    DataSection,
    EngineSection,
    EvalSection,
    GatewaySection,
    RunConfig,
    TrackerName,
    TrainSection,
)
from harnessrl.errors import ConfigError

__all__ = [
    "KNOWN_MODELS",
    "RESERVED_ENV",
    "ConfigError",
    "ControllerSection",
    "DataSection",
    "EngineSection",
    "EvalSection",
    "GatewaySection",
    "GraderSection",
    "HarnessSection",
    "JudgeSection",
    "RunConfig",
    "TasksSection",
    "TrackerName",
    "TrainSection",
    "apply_override",
    "check_model",
    "format_errors",
    "load_config",
    "resolve_command",
    "resolve_paths",
]
