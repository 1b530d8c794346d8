"""Models out: a model written as a complete Hugging Face folder that other tools load as it is.

`save_hf_folder` writes config.json + model.safetensors (modeling/loading.py's `save_model`) and beside
them the files that make the folder a model rather than a bag of weights: the tokenizer files with the
chat template, and generation_config.json (the stop tokens), all copied from the folder the model was
loaded from, so `transformers.AutoModelForCausalLM.from_pretrained(out)`, `AutoTokenizer` and vLLM
take the folder as they take the original. Training state (optimizer, schedule) is never written here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.families import config_to_hf
from harnessrl.modeling.loading import save_model

log = logging.getLogger(__name__)

# Tokenizer and generation files of an HF folder, whichever a model ships (copied when present).
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
GENERATION_CONFIG = "generation_config.json"


def copy_assets(src: Path | str, out: Path | str) -> list[str]:
    """Copy the tokenizer/chat-template/generation files present in `src` into `out`; their names."""
    src, out = Path(src), Path(out)
    copied = []
    for name in ASSET_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    return copied


def generation_config(model: CausalLM) -> dict[str, Any]:
    """A minimal generation_config.json from config.json's token ids (when the source folder has none)."""
    hf = config_to_hf(model.config)
    out = {"bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf.get("eos_token_id")}
    if hf.get("pad_token_id") is not None:
        out["pad_token_id"] = hf["pad_token_id"]
    return out


def save_hf_folder(
    model: CausalLM,
    out: Path | str,
    assets_from: Path | str | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` as a complete HF folder: weights, config, tokenizer + chat template, generation config.

    `assets_from`: the folder whose tokenizer files to copy; default: the one the model was loaded from.
    `state`: weights to write instead of the model's own (HF names; a LoRA adapter merged in).
    """
    out = save_model(model, out, state)
    src = assets_from or model.config.source_dir
    copied = copy_assets(src, out) if src else []
    if "tokenizer.json" not in copied and not (out / "tokenizer.json").is_file():
        log.warning("event=hf_folder_without_tokenizer out=%s source=%s", out, src)
    if not (out / GENERATION_CONFIG).is_file():
        (out / GENERATION_CONFIG).write_text(json.dumps(generation_config(model), indent=2))
    return out
