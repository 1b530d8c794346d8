"""Qwen3.5's and Gemma 4's real chat templates (tests/fixtures/chat_templates): rendered as transformers
renders them, their tool-call and thinking formats detected from the template, and what the model writes
in them parsed back, whole and streamed one token at a time."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from harnessrl.chat import ChatFormat
from harnessrl.chat.xmlcalls import convert_value
from tests.chat.test_template import hf_tokenizer
from tests.support.conversations import TOOL_CONVERSATION, TOOLS
from tests.support.templates import BASES, template_folder, template_source

TYPED_TOOLS: list[dict[str, Any]] = [*TOOLS, {"type": "function", "function": {
    "name": "note", "description": "Save a note.", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "pinned": {"type": "boolean"}, "weight": {"type": "number"}, "meta": {"type": "object"}}}}}]  # fmt: skip
CALLS = [("add", {"a": 2, "b": 3}),
         ("note", {"text": "a, b} <x> ü 42", "tags": ["x", "y, z"], "pinned": True, "weight": 2.5,
                   "meta": {"k": [1, "v"]}})]  # fmt: skip


@cache
def folder(name: str, root: str) -> Path:
    return template_folder(name, Path(root))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("templates"))


def _assistant(calls: list[tuple[str, dict[str, Any]]], reasoning: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}  # fmt: skip
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def _written(
    fmt: ChatFormat, calls: list[tuple[str, dict[str, Any]]], reasoning: str | None, **kw: Any
) -> str:
    """What the model writes for `calls`: the assistant turn the template renders after the prompt."""
    head = [{"role": "user", "content": "Add 2 and 3, then note it."}]
    prompt = fmt.render(head, TYPED_TOOLS, True, **kw)
    full = fmt.render([*head, _assistant(calls, reasoning)], TYPED_TOOLS, False, **kw)
    marker = "<|im_start|>assistant\n" if "<|im_start|>" in prompt else "<|turn>model\n"
    start = full.rindex(marker) + len(marker)
    written = full[start:].removesuffix("\n")
    opened = prompt[prompt.rindex(marker) + len(marker) :]  # what the generation prompt already holds
    assert written.startswith(opened), (written, opened)
    return written[len(opened) :]


def _streamed(fmt: ChatFormat, text: str) -> tuple[str, str, Any]:
    """Feed `text` one character at a time; return streamed reasoning, streamed content and the parse."""
    stream = fmt.streaming_parser(TYPED_TOOLS)
    reasoning = content = ""
    for ch in text:
        r, c = stream.feed_parts(ch)
        reasoning, content = reasoning + r, content + c
    parsed, rest = stream.finish()
    return reasoning + stream.reasoning_rest(parsed), content + rest, parsed


def _calls(parsed: Any) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_renders_as_transformers(name: str, root: str) -> None:
    path = folder(name, root)
    fmt = ChatFormat.from_folder(path)
    hf, source = hf_tokenizer(BASES[name]), template_source(name)  # the same tokenizer, loaded once
    messages = [*TOOL_CONVERSATION[:2], _assistant(CALLS, "Add, then note."),
                {"role": "tool", "tool_call_id": "call_0", "content": "5"},
                {"role": "tool", "tool_call_id": "call_1", "content": "saved"}, *TOOL_CONVERSATION[4:]]  # fmt: skip
    for msgs in (messages, TOOL_CONVERSATION):
        for thinking in (False, True):
            ours = fmt.render(msgs, TYPED_TOOLS, True, enable_thinking=thinking)
            ref = hf.apply_chat_template(msgs, tools=TYPED_TOOLS, tokenize=False, add_generation_prompt=True,
                                         chat_template=source, enable_thinking=thinking)  # fmt: skip
            assert ours == ref
    assert fmt.renderer == "template"


def test_formats_are_detected_from_the_template(root: str) -> None:
    qwen = ChatFormat.from_folder(folder("qwen3_5", root))
    assert qwen.tool_parser == "qwen3_coder" and qwen.rules.think is not None
    assert (
        not qwen.rules.think_started
    )  # this template's default: thinking off, `<think>\n\n</think>` in the prompt
    thinking = ChatFormat.from_folder(folder("qwen3_5", root), template_kwargs={"enable_thinking": True})
    assert thinking.rules.think_started  # the prompt ends with `<think>\n`: only `</think>` is generated
    gemma = ChatFormat.from_folder(folder("gemma4", root))
    assert gemma.tool_parser == "gemma4" and gemma.rules.think is not None
    assert gemma.rules.think.open == "<|channel>" and "<turn|>" in gemma.rules.stop_texts


@pytest.mark.parametrize("name", ["qwen3_5", "gemma4"])
def test_calls_written_in_the_template_format_parse_back(name: str, root: str) -> None:
    kw = {"enable_thinking": True}
    fmt = ChatFormat.from_folder(folder(name, root), template_kwargs=kw)
    text = _written(fmt, CALLS, "Add, then note.", **kw)
    stop = "<|im_end|>" if name == "qwen3_5" else "<turn|>"
    assert text.endswith(stop)
    if name == "gemma4":  # this template does not render old thinking back: the model writes it first
        text = "<|channel>thought\nAdd, then note.<channel|>" + text
    parsed = fmt.parse(text, TYPED_TOOLS)
    assert _calls(parsed) == CALLS
    assert parsed.reasoning_content == "Add, then note." and parsed.content.strip() == ""
    reasoning, content, streamed = _streamed(fmt, text)
    assert (reasoning, content.strip()) == ("Add, then note.", "") and _calls(streamed) == CALLS


def test_qwen35_call_before_closing_the_thinking(root: str) -> None:
    fmt = ChatFormat.from_folder(folder("qwen3_5", root), template_kwargs={"enable_thinking": True})
    text = ("I should add them.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
            "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>")  # fmt: skip
    parsed = fmt.parse(text, TYPED_TOOLS)
    assert parsed.reasoning_content == "I should add them." and _calls(parsed) == [CALLS[0]]
    reasoning, content, streamed = _streamed(fmt, text)
    assert reasoning == "I should add them." and content == "" and _calls(streamed) == [CALLS[0]]
    closed_late = text.replace("</tool_call>", "</tool_call>\n</think>\n\n")
    assert _calls(fmt.parse(closed_late, TYPED_TOOLS)) == [CALLS[0]]


def test_qwen35_answer_and_untyped_arguments(root: str) -> None:
    fmt = ChatFormat.from_folder(folder("qwen3_5", root), template_kwargs={"enable_thinking": True})
    parsed = fmt.parse("Easy.\n</think>\n\nIt is 5.<|im_end|>")
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == ("Easy.", "It is 5.", [])
    # without a schema: JSON values other than strings are read as such, the rest stays text
    assert [convert_value(v, None) for v in ("2", "true", "[1]", "x y", '"q"')] == [
        2,
        True,
        [1],
        "x y",
        '"q"',
    ]
    assert convert_value("007", {"type": "string"}) == "007" and convert_value("2", {"type": "number"}) == 2
    bad = "<tool_call>\n<parameter=a>\n2\n</parameter>\n</tool_call>"  # no <function=...>: stays content
    assert fmt.parse("\n</think>\n\n" + bad).content == bad


def test_gemma4_answer_thinking_and_malformed_call(root: str) -> None:
    kw = {"enable_thinking": True}
    fmt = ChatFormat.from_folder(folder("gemma4", root), template_kwargs=kw)
    parsed = fmt.parse("<|channel>thought\nTwo plus three.<channel|>It is 5.<turn|>")
    assert (parsed.reasoning_content, parsed.content) == ("Two plus three.", "It is 5.")
    reasoning, content, _ = _streamed(fmt, "<|channel>thought\nTwo plus three.<channel|>It is 5.<turn|>")
    assert (reasoning, content) == ("Two plus three.", "It is 5.")
    off = ChatFormat.from_folder(folder("gemma4", root))  # thinking off: the prompt closed the channel
    assert off.parse("It is 5.<turn|>").content == "It is 5."
    bad = "<|tool_call>call:add{a:2,b:<tool_call|>"
    assert off.parse(bad).content == bad and off.parse(bad).tool_calls == []


def test_a_requests_thinking_switch_decides_where_the_completion_begins(root: str) -> None:
    """Qwen3.5's template opens `<think>` in the prompt only when the request turns thinking on."""
    fmt = ChatFormat.from_folder(folder("qwen3_5", root))  # the run: thinking off
    text = "Two and three.\n</think>\n\nIt is 5.<|im_end|>"
    assert fmt.parse(text).reasoning_content is None
    on = fmt.for_request({"enable_thinking": True})
    assert on.rules.think_started and on.parse(text).reasoning_content == "Two and three."
    assert on.parse(text).content == "It is 5." and fmt.for_request({"enable_thinking": False}) is fmt
