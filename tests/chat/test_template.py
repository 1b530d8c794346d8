"""The model's own chat template, rendered by harnessrl, against transformers' `apply_chat_template`.

Real tokenizers and templates of five families (.cache/tokenizers, `make install`); transformers loads
the same folder. A multi-turn conversation with a system prompt, tools, an assistant tool call and a
tool result must render byte-identically. Templates without tools (Llama 3.0, Gemma 3) render the
conversation after `fold_tools`: transformers gets the folded messages, so the comparison checks that
the template itself is rendered as transformers renders it, and separate assertions check the fold.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from harnessrl.chat import ChatFormat, ChatFormatError
from harnessrl.chat.convention import fold_tools
from harnessrl.chat.template import JinjaTemplate, load_template
from tests.support.conversations import (
    FAMILIES,
    FOLDED,
    NATIVE_TOOLS,
    TOOL_CONVERSATION,
    TOOLS,
    openai_shaped,
    tokenizer_dir,
)

transformers = pytest.importorskip("transformers")
DATE = {"date_string": "26 Jul 2024"}  # Llama 3.2 writes today's date otherwise


@cache
def chat_format(family: str) -> ChatFormat:
    """harnessrl's chat format of the family's folder (built once per test session)."""
    return ChatFormat.from_folder(tokenizer_dir(family))


@cache
def hf_tokenizer(family: str) -> Any:
    """transformers' tokenizer for the family's folder (loaded once per test session)."""
    folder = tokenizer_dir(family)
    if not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{folder} is missing: run `make install` (the $(TOKENIZERS) target)")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def reference(
    family: str, messages: list[dict[str, Any]], tools: Any = None, gen: bool = True, **kw: Any
) -> str:
    """What transformers renders for these messages."""
    out = hf_tokenizer(family).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kw
    )
    assert isinstance(out, str)
    return out


@pytest.mark.parametrize("family", NATIVE_TOOLS)
def test_tool_conversation_matches_transformers(family: str) -> None:
    fmt = chat_format(family)
    ours = fmt.render(TOOL_CONVERSATION, TOOLS, True, **DATE)
    assert ours == reference(family, TOOL_CONVERSATION, TOOLS, **DATE)
    assert '"add"' in ours and "2+3 is 5." in ours  # tools and every turn made it into the prompt


@pytest.mark.parametrize("family", FOLDED)
def test_template_without_tools_renders_the_folded_conversation(family: str) -> None:
    fmt = chat_format(family)
    assert fmt.renderer == "folded"
    ours = fmt.render(TOOL_CONVERSATION, TOOLS, True)
    folded = fold_tools(TOOL_CONVERSATION, TOOLS)
    assert ours == reference(family, folded)
    assert ours.count("# Tools") == 1 and '{"name": "add", "description": "Add two integers."' in ours
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in ours
    assert "<tool_response>\n5\n</tool_response>" in ours


def test_gemma3_fold_keeps_turns_alternating() -> None:
    folded = fold_tools(TOOL_CONVERSATION, TOOLS)
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user", "assistant", "user"]
    with pytest.raises(ChatFormatError, match="alternate"):  # the template's own rule, raised through jinja
        chat_format("gemma3").template.render(TOOL_CONVERSATION)  # type: ignore[union-attr]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_conversation_matches_transformers(family: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "  Bye  "},
    ]
    fmt = chat_format(family)
    for gen in (True, False):
        assert fmt.render(messages, None, gen, **DATE) == reference(family, messages, None, gen, **DATE)
    no_system = messages[1:]
    assert fmt.render(no_system, None, True, **DATE) == reference(family, no_system, None, True, **DATE)


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_shaped_messages_render_like_hf_shaped(family: str) -> None:
    fmt = chat_format(family)
    hf = fmt.render(TOOL_CONVERSATION, TOOLS, True, **DATE)
    assert fmt.render(openai_shaped(TOOL_CONVERSATION), TOOLS, True, **DATE) == hf


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_thinking_matches_transformers(thinking: bool | None) -> None:
    kw = {} if thinking is None else {"enable_thinking": thinking}
    messages = [
        *TOOL_CONVERSATION[:4],
        {"role": "assistant", "content": "2+3 is 5.", "reasoning_content": "The tool said 5."},
    ]
    fmt = chat_format("qwen3")
    ours = fmt.render(messages, TOOLS, False, **kw)
    assert ours == reference("qwen3", messages, TOOLS, False, **kw)
    assert "<think>\nThe tool said 5.\n</think>\n\n2+3 is 5." in ours
    prompt = fmt.render(messages[:2], TOOLS, True, **kw)
    assert prompt == reference("qwen3", messages[:2], TOOLS, True, **kw)
    assert prompt.endswith("<think>\n\n</think>\n\n") == (thinking is False)


def test_run_level_template_kwargs_are_overridden_per_request() -> None:
    fmt = ChatFormat.from_folder(tokenizer_dir("qwen3"), template_kwargs={"enable_thinking": False})
    messages = TOOL_CONVERSATION[:2]
    assert fmt.render(messages).endswith("<think>\n\n</think>\n\n")
    assert not fmt.render(messages, enable_thinking=True).endswith("</think>\n\n")


def test_special_tokens_come_from_the_folder() -> None:
    template = load_template(tokenizer_dir("llama3"))
    assert template is not None and template.special_tokens["bos_token"] == "<|begin_of_text|>"
    gemma = load_template(tokenizer_dir("gemma3"))
    assert gemma is not None and gemma.render([{"role": "user", "content": "x"}]).startswith(
        "<bos><start_of_turn>user"
    )


def test_generation_blocks_compile_and_render_as_transformers() -> None:
    """Templates that mark the assistant's text with transformers' `{% generation %}` block (for assistant
    masks) compile, and the block renders its body as transformers renders it."""
    source = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
        "{%- else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "x"},
    ]
    ours = JinjaTemplate(source).render(msgs, None, True)
    assert ours == reference("qwen2_5", msgs, chat_template=source)
    assert "<|im_start|>assistant5<|im_end|>" in ours  # the block kept its body
