"""The Qwen2 family (Qwen2, Qwen2.5): `Qwen2ForCausalLM` in config.json.

A Llama with biases on the q/k/v projections (not on o_proj). Qwen2's optional sliding window
(`use_sliding_window`, off in every released Qwen2.5 model) is refused rather than ignored.
"""

from __future__ import annotations

from typing import Any

from harnessrl.modeling.llama import base_config
from harnessrl.modeling.transformer import ModelConfig

ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Read a Qwen2 config.json dict."""
    if d.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window is not supported for Qwen2; set it to false")
    return base_config(d, "Qwen2ForCausalLM", qkv_bias=True)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen2 models are only read from a folder (their config.json is written back as it was)."""
    raise ValueError("a Qwen2 config is written from the config.json it was read from (hf_config)")
