"""Decode token ids with the run's tokenizer (`tokenizer.json` of its model), without importing torch.

`harnessrl.modeling.loading.resolve_model` imports torch, so the model directory is found here by the
same rules (a directory, or the packaged SmolLM2 in the harnessrl cache); when no tokenizer is found
the ids are shown as `<id>`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# The same names as harnessrl.modeling.loading (kept here to avoid importing torch)
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}


def _cache_dir() -> Path:
    from harnessrl.defaults import cache_dir

    return cache_dir()


def tokenizer_file(model: str | None, run_dir: Path | None = None) -> Path | None:
    """The `tokenizer.json` of a run's model (a directory, or "smollm2"), or None when absent."""
    if not model:
        return None
    if model.lower() in SMOLLM2_ALIASES or model == SMOLLM2_NAME:
        base = _cache_dir()
        candidates = [base / SMOLLM2_NAME, base / f"{SMOLLM2_NAME}-tokenizer"]
    else:
        path = Path(model).expanduser()
        candidates = [path] if path.is_absolute() or run_dir is None else [path, run_dir / path]
    for d in candidates:
        if (d / "tokenizer.json").is_file():
            return d / "tokenizer.json"
    return None


class Decoder:
    """Token ids to text: whole sequences and one piece per token (special tokens kept)."""

    def __init__(self, tokenizer: Tokenizer | None, source: str) -> None:
        self.tokenizer = tokenizer
        self.source = source  # the tokenizer file, or why there is none

    @property
    def available(self) -> bool:
        """True when ids are decoded with a real tokenizer."""
        return self.tokenizer is not None

    def text(self, ids: list[int]) -> str:
        """The text of a sequence of ids."""
        if self.tokenizer is None:
            return " ".join(f"<{i}>" for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def pieces(self, ids: list[int]) -> list[str]:
        """One string per token (a token holding part of a UTF-8 character shows as U+FFFD)."""
        if self.tokenizer is None:
            return [f"<{i}>" for i in ids]
        return list(self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False))


def load_decoder(model: str | None, run_dir: Path | None = None, override: Path | None = None) -> Decoder:
    """A decoder for the run's model; `override` (a tokenizer.json or a folder holding one) wins."""
    path: Path | None
    if override is not None:
        path = override / "tokenizer.json" if override.is_dir() else override
        if not path.is_file():
            return Decoder(None, f"no tokenizer.json at {override}")
    else:
        path = tokenizer_file(model, run_dir)
        if path is None:
            return Decoder(None, f"no tokenizer.json found for model {model!r}")
    try:
        return Decoder(Tokenizer.from_file(str(path)), str(path))
    except Exception as e:  # a corrupt file: show ids rather than fail
        log.warning("event=tokenizer_unreadable path=%s error=%s", path, e)
        return Decoder(None, f"{path} is unreadable: {e}")
