"""The Llama family (SmolLM2, Llama 3.x): `LlamaForCausalLM` in config.json.

The plainest use of modeling/transformer.py: pre-norm blocks, SwiGLU, RMSNorm scaling by w, no biases
(unless `attention_bias` / `mlp_bias`), RoPE plain or scaled (linear, YaRN, Llama 3's `llama3`). A new
family module has this shape: the architecture names it serves, `config_from_hf` (config.json -> the
shared `ModelConfig`) and `config_to_hf` (the reverse, for a model built here).

`LlamaConfig` and `LlamaForCausalLM` remain the names of the shared config and model classes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from harnessrl.modeling.causal_lm import CausalLM, num_parameters
from harnessrl.modeling.rope import RopeScaling
from harnessrl.modeling.transformer import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)

LlamaConfig = ModelConfig
LlamaForCausalLM = CausalLM


def token_id(value: Any, default: int) -> int:
    """A config.json token id that may be an int, a list (the first is taken) or null (the default)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return default if value is None else int(value)


def rope_params(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x
    (`rope_parameters`, theta inside) layouts; 5.x itself lets `rope_scaling` win when both are present."""
    params = d.get("rope_parameters") or {}
    rope = d.get("rope_scaling") or params
    theta = rope.get("rope_theta", d.get("rope_theta", params.get("rope_theta", 10000.0)))
    return float(theta), rope


def base_config(d: dict[str, Any], architecture: str, **features: Any) -> ModelConfig:
    """The fields every family shares, read from a config.json dict, plus the family's `features`."""
    heads = int(d["num_attention_heads"])
    theta, rope = rope_params(d)
    max_positions = int(d.get("max_position_embeddings") or 2048)
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rope_theta=theta,
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=token_id(d.get("bos_token_id"), 1),
        eos_token_id=token_id(d.get("eos_token_id"), 2),
        rope_scaling=RopeScaling.from_hf(rope, max_positions),
        architecture=architecture,
        hf_config=dict(d),
        **features,
    )


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Read a Llama config.json dict (transformers 4.x or 5.x layout)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act {d['hidden_act']!r} is not supported for Llama; use 'silu'"
        )
    bias = bool(d.get("attention_bias", False))
    return base_config(
        d, "LlamaForCausalLM", qkv_bias=bias, o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False))
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for this config (read the same by transformers 4.x and 5.x)."""
    d: dict[str, Any] = {k: v for k, v in asdict(cfg).items() if k in _HF_KEYS}
    scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
    d.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        attention_bias=cfg.qkv_bias,
        mlp_bias=cfg.mlp_bias,
        rope_scaling=scaling,
        rope_parameters={"rope_theta": cfg.rope_theta, **(scaling or {"rope_type": "default"})},
        torch_dtype="float32",
    )
    return d


_HF_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
)  # fmt: skip

__all__ = [
    "ARCHITECTURES",
    "LlamaConfig",
    "LlamaForCausalLM",
    "base_config",
    "config_from_hf",
    "config_to_hf",
    "num_parameters",
    "token_id",
]
