"""modeling: our plain-PyTorch model families, THE logprob definition, and model loading/saving.

Shared by the builtin engine and the trainer, so both compute logprobs with the same arithmetic. Modules:
`families` (the registry: architecture -> family module `llama`, `qwen2`, `qwen3`, `gemma3`),
`transformer` and `causal_lm` (the pieces and the model every family is made of), `rope` (rotary
frequencies, plain or linear/YaRN/llama3-scaled), `cache` (the KV cache),
`packed` (oneDNN-packed linears for the engine), `loading` (model directories, SmolLM2 and its
long-context variants), `hf_folder` (a model written as a complete HF folder), `logprobs` (THE logprob
definition).
"""

from __future__ import annotations

from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.families import supported_architectures
from harnessrl.modeling.llama import LlamaConfig, LlamaForCausalLM
from harnessrl.modeling.loading import (
    default_cache_dir,
    load_model,
    load_state_dict_file,
    load_tokenizer,
    make_tiny_model_dir,
    resolve_model,
    save_model,
    smollm2_dir,
    smollm2_long_dir,
    write_rope_scaled_dir,
)
from harnessrl.modeling.logprobs import next_token_logprobs, token_logprobs
from harnessrl.modeling.rope import RopeScaling, RopeType
from harnessrl.modeling.transformer import ModelConfig

__all__ = [
    "CausalLM",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelConfig",
    "RopeScaling",
    "RopeType",
    "default_cache_dir",
    "load_model",
    "load_state_dict_file",
    "load_tokenizer",
    "make_tiny_model_dir",
    "next_token_logprobs",
    "resolve_model",
    "save_model",
    "smollm2_dir",
    "smollm2_long_dir",
    "supported_architectures",
    "token_logprobs",
    "write_rope_scaled_dir",
]
