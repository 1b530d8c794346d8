"""The model families the builtin engine and trainer compute, by config.json's `architectures`.

One place says which families exist: `FAMILIES` maps an architecture name to the module that reads its
config.json (modeling/llama.py shows the shape). All families share one model (modeling/causal_lm.py,
pieces in modeling/transformer.py), so the engine's KV cache, batching, chunked prefill and prefix cache
and the trainer's forward serve every family alike. Adding a family is one module and one line here.
An architecture not listed is refused at load with the list (docs/models.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from harnessrl.modeling.transformer import ModelConfig

FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "harnessrl.modeling.llama",
    "Qwen2ForCausalLM": "harnessrl.modeling.qwen2",
    "Qwen3ForCausalLM": "harnessrl.modeling.qwen3",
    "Gemma3ForCausalLM": "harnessrl.modeling.gemma3",
}
# config.json without `architectures` (rare): its `model_type` names the family
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    """config.json names an architecture no family module computes."""


def supported_architectures() -> list[str]:
    """The architecture names `engine.model` and the trainer accept."""
    return list(FAMILIES)


def architecture_of(hf: dict[str, Any]) -> str:
    """The family's architecture name of a config.json dict; UnsupportedArchitecture if none fits."""
    names = [str(a) for a in hf.get("architectures") or []]
    for name in names:
        if name in FAMILIES:
            return name
    model_type = str(hf.get("model_type", ""))
    if not names and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    found = names[0] if names else f"model_type {model_type!r}" if model_type else "nothing"
    raise UnsupportedArchitecture(
        f"config.json: architectures names {found}, which harnessrl's builtin engine and trainer do not "
        f"compute; supported: {', '.join(FAMILIES)} (serve other models with engine.kind: vllm, or add a "
        "family module under harnessrl/modeling/, see docs/models.md)"
    )


def family_module(architecture: str) -> ModuleType:
    """The module of a supported architecture (it has `config_from_hf` and `config_to_hf`)."""
    if architecture not in FAMILIES:
        architecture_of({"architectures": [architecture]})  # raises with the list
    return importlib.import_module(FAMILIES[architecture])


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Read a config.json dict into the shared ModelConfig through its family's module."""
    cfg: ModelConfig = family_module(architecture_of(hf)).config_from_hf(hf)
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `cfg`: the one it was read from, or (a model built here) its family's writer."""
    if cfg.hf_config is not None:
        return dict(cfg.hf_config)
    return family_module(cfg.architecture).config_to_hf(cfg)
