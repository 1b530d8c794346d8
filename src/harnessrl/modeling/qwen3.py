"""The Qwen3 family (dense Qwen3): `Qwen3ForCausalLM` in config.json.

A Llama with an RMSNorm over each head of q and k before RoPE (`q_norm`, `k_norm`), an explicit
`head_dim` (heads x head_dim may differ from hidden_size) and no biases (unless `attention_bias`).
"""

from __future__ import annotations

from typing import Any

from harnessrl.modeling.llama import base_config
from harnessrl.modeling.transformer import ModelConfig

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Read a Qwen3 config.json dict."""
    if d.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window is not supported for Qwen3; set it to false")
    bias = bool(d.get("attention_bias", False))
    return base_config(d, "Qwen3ForCausalLM", qk_norm=True, qkv_bias=bias, o_bias=bias)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3 models are only read from a folder (their config.json is written back as it was)."""
    raise ValueError("a Qwen3 config is written from the config.json it was read from (hf_config)")
