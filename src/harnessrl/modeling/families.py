"""The model families the builtin engine and trainer compute, by config.json's `architectures`.

One place says which families exist: `FAMILIES` maps an architecture name to the module that reads its
config.json (modeling/llama.py shows the shape). All families share one model (modeling/causal_lm.py,
pieces in modeling/transformer.py), so the engine's KV cache, batching, chunked prefill and prefix cache
and the trainer's forward serve every family alike. Adding a family is one module and one line here.
Which PATH a folder takes is decided here too (`model_impl`): a builtin family when config.json names
one, else transformers' own implementation (modeling/hf_generic.py), overridable by `engine.model_impl`
(exported to every process of a run as HARNESSRL_MODEL_IMPL). docs/models.md says what each costs.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from harnessrl.defaults import MODEL_IMPL_ENV
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


# `engine.model_impl`: "auto" (builtin family if config.json names one, else transformers), "builtin",
# "transformers"; every process of a run reads it from MODEL_IMPL_ENV (the engine, the trainer's ranks)
MODEL_IMPLS = ("auto", "builtin", "transformers")


def transformers_implements(hf: dict[str, Any]) -> bool:
    """True when the installed transformers has a model class for config.json's model_type."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return str(hf.get("model_type", "")) in CONFIG_MAPPING_NAMES


def model_impl(hf: dict[str, Any], impl: str | None = None) -> str:
    """THE choice of path for a config.json dict: "builtin" (our family modules) or "transformers".

    `impl` (default: $HARNESSRL_MODEL_IMPL, else "auto") may force either; "builtin" for an architecture
    no family computes raises UnsupportedArchitecture, "transformers" for one transformers lacks a
    ValueError naming the model_type."""
    impl = impl or os.environ.get(MODEL_IMPL_ENV) or "auto"
    if impl not in MODEL_IMPLS:
        raise ValueError(f"engine.model_impl must be one of {', '.join(MODEL_IMPLS)}, not {impl!r}")
    if impl == "builtin":
        architecture_of(hf)
        return "builtin"
    if impl == "auto":
        try:
            architecture_of(hf)
            return "builtin"
        except UnsupportedArchitecture as exc:
            if not transformers_implements(hf):
                raise UnsupportedArchitecture(
                    f"{exc}; nor does the installed transformers implement model_type {hf.get('model_type')!r}"
                ) from None
    if not transformers_implements(hf):
        raise ValueError(
            f"config.json: model_type {hf.get('model_type')!r} is not implemented by the installed transformers "
            "(upgrade transformers, or set engine.model_impl: builtin for one of the builtin families)"
        )
    return "transformers"


def model_impl_of(path: str | Path, impl: str | None = None) -> str:
    """`model_impl` of a model folder's config.json."""
    return model_impl(json.loads((Path(path) / "config.json").read_text()), impl)


def describe_path(path: str | Path, impl: str | None = None) -> str:
    """One line for `harnessrl check` and `doctor`: which path serves and trains the folder, and why."""
    hf = json.loads((Path(path) / "config.json").read_text())
    chosen = model_impl(hf, impl)
    names = ", ".join(str(a) for a in hf.get("architectures") or []) or f"model_type {hf.get('model_type')}"
    if chosen == "builtin":
        return f"builtin family ({architecture_of(hf)}): harnessrl's own modules, packed CPU matmuls"
    text = hf.get("text_config")
    part = f", its text model ({text.get('model_type')})" if isinstance(text, dict) else ""
    return f"transformers ({names}{part}): transformers' implementation, one cache per sequence"
