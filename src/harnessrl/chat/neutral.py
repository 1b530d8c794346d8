"""A chat format for a model folder without a chat template: its family's own turn markers, or a refusal.

A base model (the `gemma3-270m` GGUF carries no template) still has the turn markers of its family in its
vocabulary; the prompt is written with them, with no default system prompt:

- `<start_of_turn>`/`<end_of_turn>` (Gemma): `<start_of_turn>user\\n...<end_of_turn>\\n`, the assistant's
  turns as `model`, a system text at the start of the next user turn (as Gemma 3's own template does);
- `<|start_header_id|>`/`<|eot_id|>` (Llama 3): `<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`;
- `<|im_start|>`/`<|im_end|>` (ChatML): the ChatML convention of `chatml.py` without SmolLM2's system prompt.

Tools, tool calls and results are written with the convention of `convention.py` (`hermes` calls). A
vocabulary with none of these markers is refused: its model has no way to mark a turn's end.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.chat.chatml import ChatFormatError

GEMMA = (
    "{{- bos_token }}{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{%- set ns.system = ns.system + m['content'] + '\\n\\n' %}"
    "{%- elif m['role'] == 'assistant' %}{{- '<start_of_turn>model\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- else %}{{- '<start_of_turn>user\\n' + ns.system + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- set ns.system = '' %}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CONVENTIONS = (
    ("gemma", ("<start_of_turn>", "<end_of_turn>"), GEMMA),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
    ("chatml", ("<|im_start|>", "<|im_end|>"), None),
)


def neutral_convention(folder: Path, vocab: dict[str, int]) -> tuple[str, str | None]:
    """(name, template source) of the turn convention a folder's vocabulary supports (source None: the
    ChatML convention); `ChatFormatError` naming the fix when it supports none."""
    for name, markers, source in CONVENTIONS:
        if all(m in vocab for m in markers):
            return name, source
    raise ChatFormatError(
        f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json's chat_template) and "
        "its vocabulary has none of the turn markers of Gemma (<start_of_turn>), Llama 3 "
        "(<|start_header_id|>) or ChatML (<|im_start|>): add the model's chat template to the folder as "
        "chat_template.jinja"
    )
