"""ChatFormat from real folders: SmolLM2 keeps today's ChatML convention token for token, stop tokens per
family (tokenizer_config, generation_config.json), template files and errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from harnessrl.chat import CHATML, ChatFormat, ChatFormatError, parse_completion, render_chat
from harnessrl.modeling.loading import smollm2_tokenizer_dir
from tests.support.conversations import TOOL_CONVERSATION, TOOLS, openai_shaped, tokenizer_dir


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's real tokenizer folder (its own template: ChatML without tools)."""
    return smollm2_tokenizer_dir()


def test_smollm2_keeps_the_chatml_convention(smollm2: Path) -> None:
    fmt = ChatFormat.from_folder(smollm2)
    assert (fmt.renderer, fmt.tool_parser) == ("chatml", "hermes")
    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    for messages, tools in (
        (TOOL_CONVERSATION, TOOLS),
        (openai_shaped(TOOL_CONVERSATION), TOOLS),
        (TOOL_CONVERSATION[1:2], None),
    ):
        ours = fmt.render(messages, tools)
        assert ours == render_chat(messages, tools) == CHATML.render(messages, tools)
        assert (
            tok.encode(ours, add_special_tokens=False).ids
            == tok.encode(render_chat(messages, tools), add_special_tokens=False).ids
        )
    text = 'ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|im_end|>'
    ours, today = fmt.parse(text), parse_completion(text)
    assert (ours.content, [c["function"] for c in ours.tool_calls]) == (
        today.content,
        [c["function"] for c in today.tool_calls],
    )
    assert fmt.stop_ids == {tok.token_to_id("<|im_end|>")} | _config_eos(smollm2)


def _config_eos(folder: Path) -> set[int]:
    path = folder / "config.json"
    return {json.loads(path.read_text())["eos_token_id"]} if path.is_file() else set()


def test_smollm2_chatml_equals_its_own_template_without_tools(smollm2: Path) -> None:
    fmt = ChatFormat.from_folder(smollm2)
    assert fmt.template is not None
    plain = [m for m in TOOL_CONVERSATION if m["role"] in ("system", "user") or not m.get("tool_calls")]
    plain = [m for m in plain if m["role"] != "tool"]
    for messages in (plain, plain[1:]):
        assert fmt.render(messages) == fmt.template.render(messages)


@pytest.mark.parametrize(
    ("family", "stops"),
    [
        ("qwen3", {"<|im_end|>"}),
        ("qwen2_5", {"<|im_end|>"}),
        ("llama3", {"<|eot_id|>", "<|end_of_text|>"}),
        ("llama3_2", {"<|eot_id|>", "<|eom_id|>"}),
        ("gemma3", {"<end_of_turn>"}),
    ],
)
def test_stop_tokens_per_family(family: str, stops: set[str], tmp_path: Path) -> None:
    folder = tmp_path / family
    shutil.copytree(tokenizer_dir(family), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = {tok.token_to_id(s) for s in stops}
    fmt = ChatFormat.from_folder(folder)
    assert set(fmt.rules.stop_texts) == stops and fmt.stop_ids == expected
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert ChatFormat.from_folder(folder).stop_ids == expected | {7, 8}


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    shutil.copy(tokenizer_dir("qwen2_5") / "tokenizer_config.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    fmt = ChatFormat.from_folder(tmp_path)
    assert fmt.render([{"role": "user", "content": "hi"}]) == "[user]hi"
    assert fmt.renderer == "folded"


def test_errors_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatFormatError, match="chat_template does not compile"):
        ChatFormat.from_folder(tmp_path)
    fmt = ChatFormat.from_folder(tokenizer_dir("qwen3"))
    with pytest.raises(ChatFormatError, match=r"messages\[1\] must be an object"):
        fmt.render([{"role": "user", "content": "x"}, "oops"])  # type: ignore[list-item]
    with pytest.raises(ChatFormatError, match=r"messages\[0\].tool_calls\[0\].function.name"):
        fmt.render([{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}])


def test_folder_without_template_gets_its_familys_markers(tmp_path: Path) -> None:
    """No SmolLM2 system prompt and no foreign `<|im_end|>`: the vocabulary's own turn markers, or a refusal."""
    gemma, llama, chatml = (tmp_path / n for n in ("gemma", "llama", "chatml"))
    for folder, family in ((gemma, "gemma3"), (llama, "llama3"), (chatml, "qwen2_5")):
        folder.mkdir()
        shutil.copy(tokenizer_dir(family) / "tokenizer.json", folder)
    fmt = ChatFormat.from_folder(gemma)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
             {"role": "assistant", "content": "5"}, {"role": "user", "content": "4+4?"}]  # fmt: skip
    assert fmt.render(convo) == (
        "<start_of_turn>user\nBe brief.\n\n2+3?<end_of_turn>\n<start_of_turn>model\n5<end_of_turn>\n"
        "<start_of_turn>user\n4+4?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert (
        fmt.rules.stop_texts == ("<end_of_turn>",)
        and 106 in fmt.stop_ids
        and "SmolLM" not in fmt.render(convo)
    )
    tooled = fmt.render(TOOL_CONVERSATION, TOOLS)
    assert (
        "# Tools" in tooled
        and '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in tooled
    )
    assert fmt.parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><end_of_turn>').tool_calls
    lfmt = ChatFormat.from_folder(llama)
    assert lfmt.render(convo[1:2]) == (
        "<|start_header_id|>user<|end_header_id|>\n\n2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert "<|eot_id|>" in lfmt.rules.stop_texts
    cfmt = ChatFormat.from_folder(chatml)
    assert (
        cfmt.renderer == "chatml"
        and cfmt.render(convo[1:2]) == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ChatFormatError, match=r"has no chat template.*chat_template\.jinja"):
        ChatFormat.from_folder(tmp_path)
