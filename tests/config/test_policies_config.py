"""`policies:` in the run config: each policy needs LoRA (a clear error otherwise), names are checked,
a model name chooses one policy only, and the first policy listed is the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.config import load_config
from harnessrl.errors import ConfigError


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_policies_need_lora_and_valid_distinct_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set train\.lora"):
        load_config(_config(tmp_path, "policies: {planner: {}, solver: {}}\n"))
    with pytest.raises(ConfigError, match="not a valid policy name"):
        load_config(_config(tmp_path, "train: {lora: {}}\npolicies: {'a/b': {}}\n"))
    with pytest.raises(ConfigError, match="chooses both 'planner' and 'solver'"):
        load_config(
            _config(tmp_path, "train: {lora: {}}\npolicies: {planner: {}, solver: {models: [planner]}}\n")
        )
    with pytest.raises(ConfigError, match=r"policies\.planner\.modles"):
        load_config(_config(tmp_path, "train: {lora: {}}\npolicies: {planner: {modles: [x]}}\n"))


def test_policy_models_keep_the_order_the_default_first(tmp_path: Path) -> None:
    text = "train: {lora: {r: 4}}\npolicies:\n  solver: {models: [gpt-4o, solver]}\n  planner: {}\n"
    cfg = load_config(_config(tmp_path, text))
    assert cfg.policy_models() == {"solver": ["solver", "gpt-4o"], "planner": ["planner"]}
    assert load_config(None, ["train.lora={}", "policies.a={}"]).policy_models() == {"a": ["a"]}
