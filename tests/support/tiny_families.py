"""Tiny random Llamas carrying a family's real tokenizer and chat template (for chat-format tests).

The chat format depends on the folder's tokenizer files only; the model is a one-layer Llama with the
family's vocabulary, so the builtin engine serves it today (the families' own architectures come with
tests/support/families.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from harnessrl.modeling.llama import LlamaConfig, LlamaForCausalLM
from harnessrl.modeling.loading import save_model
from tests.support.conversations import tokenizer_dir

FAMILY_IDS = {"llama3_2": (128256, 128000, 128009), "qwen3": (151936, 151643, 151645)}  # vocab, bos, eos


def tiny_family_dir(root: Path, family: str) -> Path:
    """A one-layer random Llama with the family's real vocabulary, tokenizer and template."""
    vocab, bos, eos = FAMILY_IDS[family]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=4096,
                      bos_token_id=bos, eos_token_id=eos)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.init_weights(0)
    out = save_model(model, root / family)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir(family) / f, out / f)
    return out
