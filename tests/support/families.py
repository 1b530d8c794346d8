"""Tiny random-weight model folders of each supported family, with the family's REAL tokenizer.

`tiny_family_dir(family, root)` writes an HF folder: the family's real config.json shape (a released
model's config with 2 layers and a small hidden size; the real vocabulary size), weights drawn at random
by transformers' own implementation of the architecture and saved with `save_pretrained` (so the folder
is what a user brings), the real tokenizer.json + tokenizer_config.json (with the real chat template)
from .cache/tokenizers/<family>/ (the Makefile target $(TOKENIZERS), part of `make install`), and the real generation_config.json stop tokens.
Weights are drawn wide enough that the logits are far from uniform: a wrong piece shows up well above
the 1e-4 bounds the tests use. Folders are cached per process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .conversations import tokenizers_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZERS = tokenizers_dir()
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}

# Released configs (Qwen3-0.6B, Qwen2.5-0.5B-Instruct, Llama-3.1-8B-Instruct, Llama-3.2-1B-Instruct,
# gemma-3-270m), shrunk by _TINY and the overrides noted; transformers 4.x layout, as on the Hub.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_key_value_heads": 2, "head_dim": 32,  # real: heads x head_dim != hidden
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen2_5": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "max_position_embeddings": 32768, "max_window_layers": 21,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "llama3": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
        "max_position_embeddings": 131072, "mlp_bias": False, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    },
    "llama3_2": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 131072, "mlp_bias": False, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None,
        "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
        "num_key_value_heads": 1, "pad_token_id": 0,
        "query_pre_attn_scalar": 24,  # real: 256 (= head_dim); another value exercises the scale
        "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 16,  # real: 512; 16 makes the window bite in short test sequences
        "layer_types": ["sliding_attention", "full_attention"],  # real: 5 sliding, then 1 full
        "use_bidirectional_attention": False, "vocab_size": 262144,
    },
}  # fmt: skip
# generation_config.json stop tokens of the released models
EOS_IDS: dict[str, list[int]] = {
    "qwen3": [151645, 151643],
    "qwen2_5": [151645, 151643],
    "llama3": [128001, 128008, 128009],
    "llama3_2": [128001, 128008, 128009],
    "gemma3": [1, 106],
}
FAMILIES = tuple(CONFIGS)
_dirs: dict[tuple[str, int], Path] = {}


def family_config(family: str) -> dict[str, Any]:
    """The tiny config.json dict of `family` (4.x layout, as released models ship it)."""
    return {**CONFIGS[family], **_TINY}


def have_tokenizer(family: str) -> bool:
    """True when `make tokenizers` has put the family's real tokenizer under .cache/tokenizers."""
    return (TOKENIZERS / family / "tokenizer.json").is_file()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Wide random weights: embeddings N(0, 1), linears N(0, 1/fan_in), norms and biases perturbed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.add_(0.2 * noise)  # Llama/Qwen norms around 1, Gemma's (1 + w) around 0
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 2 and "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def tiny_family_dir(family: str, root: Path, seed: int = 0) -> Path:
    """An HF folder of a tiny random `family` model with its real tokenizer (see the module docstring)."""
    key = (family, seed)
    if key in _dirs:
        return _dirs[key]
    from transformers import AutoConfig, AutoModelForCausalLM

    if not have_tokenizer(family):
        raise FileNotFoundError(
            f"{TOKENIZERS / family} is missing; run: make install (it unpacks the real tokenizers)"
        )
    out = root / f"tiny-{family}-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(family_config(family), indent=2))
    config = AutoConfig.from_pretrained(str(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZERS / family / name, out / name)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": EOS_IDS[family]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _dirs[key] = out
    return out


def hf_model(path: Path) -> Any:
    """transformers' own implementation of the folder's architecture, fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
