"""The Gemma 3 text family: `Gemma3ForCausalLM` (model_type `gemma3_text`) in config.json.

What it takes from modeling/transformer.py: sandwich norms (each sub-block's output normalised before
its residual), RMSNorm scaling by (1 + w) in fp32, embeddings times sqrt(hidden_size), q/k norms,
attention scaled by query_pre_attn_scalar^-1/2, GELU (tanh approximation), and two kinds of layers:
sliding-window layers (keys within `sliding_window` positions, RoPE base `rope_local_base_freq`,
unscaled) and global layers (RoPE base `rope_theta` with the config's scaling). The layer kinds come
from `layer_types`, else from `sliding_window_pattern` (every n-th layer global; default 6).
Soft-capping of the final logits is applied when set; of attention scores it is refused (released
Gemma 3 models set neither).
"""

from __future__ import annotations

from typing import Any

from harnessrl.modeling.llama import base_config
from harnessrl.modeling.transformer import FULL, SLIDING, ModelConfig

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPES = ("gemma3_text",)


def layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's kind: `layer_types` as given, else every `sliding_window_pattern`-th layer global."""
    if d.get("layer_types"):
        return tuple(str(t) for t in d["layer_types"])
    pattern = int(d.get("sliding_window_pattern") or 6)
    n = int(d["num_hidden_layers"])
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))


def _rope_layout(d: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(a config dict whose RoPE keys describe the global layers, the sliding layers' RoPE base).

    transformers 5.x nests `rope_parameters` per layer kind; 4.x writes `rope_theta`, `rope_scaling`
    and `rope_local_base_freq` at the top level."""
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = params.get(FULL) or {}
        local = float((params.get(SLIDING) or {}).get("rope_theta", 10000.0))
        return {**d, "rope_parameters": {"rope_theta": 1_000_000.0, **full}, "rope_scaling": None}, local
    out = {**d, "rope_theta": d.get("rope_theta", 1_000_000.0)}
    return out, float(d.get("rope_local_base_freq") or 10000.0)


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Read a Gemma 3 text config.json dict (transformers 4.x or 5.x layout)."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError(
            "config.json: attn_logit_softcapping is not supported; Gemma 3 models set it to null"
        )
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention is not supported for a causal LM")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    rope_dict, local_theta = _rope_layout(d)
    cfg = base_config(
        {**rope_dict, "tie_word_embeddings": d.get("tie_word_embeddings", True)},
        "Gemma3ForCausalLM",
        qk_norm=True,
        sandwich_norm=True,
        norm_offset=True,
        embed_scale=float(d["hidden_size"]) ** 0.5,
        hidden_act=str(act),
        attn_scale=float(d.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_logit_softcapping=d.get("final_logit_softcapping"),
        sliding_window=d.get("sliding_window"),
        layer_types=layer_types(d),
        local_rope_theta=local_theta,
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
    )
    cfg.hf_config = dict(d)
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma 3 models are only read from a folder (their config.json is written back as it was)."""
    raise ValueError("a Gemma 3 config is written from the config.json it was read from (hf_config)")
