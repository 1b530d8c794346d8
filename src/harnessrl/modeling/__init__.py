"""modeling: our plain-PyTorch Llama, THE logprob definition, and model loading/saving.

Shared by the builtin engine and the trainer, so both compute logprobs with the same arithmetic. Modules:
`llama` (the model), `rope` (rotary frequencies, plain or linear/YaRN-scaled), `cache` (the KV cache),
`packed` (oneDNN-packed linears for the engine), `loading` (model directories, SmolLM2 and its
long-context variants), `logprobs` (THE logprob definition).
"""

from __future__ import annotations

from harnessrl.modeling.cache import KVCache
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

__all__ = [
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
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
    "token_logprobs",
    "write_rope_scaled_dir",
]
