"""`engine.model` takes the named models `resolve_model` knows (SmolLM2 and its long-context variants,
Gemma 3 270M) as well as folders; anything else is refused naming the choices."""

from __future__ import annotations

import pytest

from harnessrl.config import ConfigError, check_model, load_config


@pytest.mark.parametrize("name", ["smollm2", "smollm2-16k", "gemma3-270m"])
def test_named_models_are_accepted(name: str) -> None:
    check_model(load_config(None, [f"engine.model={name}"]))


def test_an_unknown_model_is_refused_with_the_named_ones() -> None:
    with pytest.raises(ConfigError) as e:
        check_model(load_config(None, ["engine.model=llama-9000"]))
    assert "smollm2" in str(e.value) and "gemma3-270m" in str(e.value)
