"""modeling: our plain-PyTorch Llama, THE logprob definition, and model loading/saving.

Shared by the builtin engine and the trainer, so both compute logprobs with the same arithmetic.
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
)
from harnessrl.modeling.logprobs import next_token_logprobs, token_logprobs

__all__ = [
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "default_cache_dir",
    "load_model",
    "load_state_dict_file",
    "load_tokenizer",
    "make_tiny_model_dir",
    "next_token_logprobs",
    "resolve_model",
    "save_model",
    "smollm2_dir",
    "token_logprobs",
]
