"""Model folders for chat formats whose tokenizers are not packaged here (Qwen3.5, Gemma 4): a family's real
tokenizer (.cache/tokenizers) with the real chat template of the newer model (tests/fixtures/chat_templates,
sources in tests/fixtures/README.md) as `chat_template.jinja`, which both harnessrl and transformers read
before tokenizer_config.json's template."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.conversations import tokenizer_dir

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
BASES = {"qwen3_5": "qwen3", "gemma4": "gemma3"}  # the tokenizer each template is paired with


def template_source(name: str) -> str:
    """The text of a fixture chat template (`qwen3_5`, `gemma4`)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def template_folder(name: str, root: Path) -> Path:
    """A folder: the base family's tokenizer files and the fixture template as chat_template.jinja."""
    out = root / f"template-{name}"
    if not out.is_dir():
        out.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir(BASES[name]) / f, out / f)
        (out / "chat_template.jinja").write_text(template_source(name), encoding="utf-8")
    return out
