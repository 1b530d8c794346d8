"""Tool calls parsed back per family, thinking split from content, and the streaming parser's promise
(what streamed is a prefix of the final content and reasoning), on the real templates' own text."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.chat import ChatFormat
from harnessrl.chat.completion import CompletionRules, CompletionStream
from harnessrl.chat.reasoning import GEMMA4_THINK, THINK, split_reasoning
from harnessrl.chat.toolcalls import (
    Gemma4ToolParser,
    HermesParser,
    Llama3JsonParser,
    PythonicToolParser,
    XmlToolParser,
    tool_parser,
)
from tests.support.conversations import FAMILIES, TOOL_CONVERSATION, TOOLS, tokenizer_dir


@cache
def chat_format(family: str) -> ChatFormat:
    """The family's chat format (built once per session)."""
    return ChatFormat.from_folder(tokenizer_dir(family))


def written_tool_call(family: str) -> str:
    """The assistant turn with the tool call exactly as the family's template renders it after the
    generation prompt, cut at the end-of-turn marker: what a trained model of that family writes."""
    fmt = chat_format(family)
    kw = {"date_string": "26 Jul 2024"}
    prompt = fmt.render(TOOL_CONVERSATION[:2], TOOLS, True, **kw)
    full = fmt.render(TOOL_CONVERSATION[:3], TOOLS, False, **kw)
    assert full.startswith(prompt), family
    turn = full[len(prompt) :]
    stop = next(s for s in fmt.rules.stop_texts if s in turn)
    return turn[: turn.index(stop) + len(stop)]


@pytest.mark.parametrize("family", FAMILIES)
def test_rendered_tool_call_parses_back(family: str) -> None:
    parsed = chat_format(family).parse(written_tool_call(family))
    assert parsed.content.strip() == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    assert parsed.tool_calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("family", FAMILIES)
def test_rendered_tool_call_streams_no_markup(family: str) -> None:
    text = written_tool_call(family)
    stream = chat_format(family).streaming_parser()
    sent = "".join(stream.feed(ch) for ch in text)
    parsed, rest = stream.finish()
    assert sent + rest == parsed.content and "{" not in sent and "<" not in sent
    assert len(parsed.tool_calls) == 1


def test_detected_parsers() -> None:
    assert {f: chat_format(f).tool_parser for f in FAMILIES} == {
        "qwen3": "hermes",
        "qwen2_5": "hermes",
        "llama3": "hermes",  # no tools in Llama 3.0's template: the convention
        "llama3_2": "llama3_json",
        "gemma3": "hermes",  # no tools in Gemma 3's template: the convention
    }
    forced = ChatFormat.from_folder(tokenizer_dir("qwen2_5"), tool_parser_name="llama3_json")
    assert forced.tool_parser == "llama3_json"
    with pytest.raises(ValueError, match=r"engine.tool_parser 'xml' is unknown; use one of: auto, hermes"):
        tool_parser("xml")


def test_llama3_json_forms() -> None:
    p = Llama3JsonParser()
    tagged = p.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {}}'
    )
    assert [c["function"]["name"] for c in tagged.tool_calls] == ["add", "neg"] and tagged.content == ""
    assert (
        p.parse('{"name": "add", "arguments": {"a": 1}}').tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    )
    for text in ("The answer is {5}.", '{"name": 3}', '{"name": "add"} and more', "{not json"):
        assert p.parse(text).content == text and not p.parse(text).tool_calls


def test_hermes_keeps_malformed_blocks_as_content() -> None:
    text = 'a<tool_call>{"name": "x", "arguments": {}}</tool_call>b<tool_call>oops</tool_call>c<tool_call>{"name"'
    parsed = HermesParser().parse(text)
    assert parsed.content == 'ab<tool_call>oops</tool_call>c<tool_call>{"name"'
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["x"]


def test_qwen3_thinking_split_and_stop_marker() -> None:
    fmt = chat_format("qwen3")
    text = '<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    parsed = fmt.parse(text)
    assert parsed.reasoning_content == "Add them." and parsed.content == "" and len(parsed.tool_calls) == 1
    assert fmt.parse("Just 5.<|im_end|>").reasoning_content is None
    assert split_reasoning("<think>\ncut short") == ("cut short", "")
    assert split_reasoning("no think</think>x", started=True) == ("no think", "x")
    assert (
        chat_format("qwen2_5").parse("<think>x</think>y").content == "<think>x</think>y"
    )  # no thinking there


def test_qwen3_thinking_re_renders_to_the_written_text() -> None:
    fmt = chat_format("qwen3")
    written = "<think>\nAdd them.\n</think>\n\n2+3 is 5."
    parsed = fmt.parse(written + "<|im_end|>")
    msgs = [
        *TOOL_CONVERSATION[:2],
        {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning_content},
    ]
    assert (
        fmt.render(msgs, TOOLS, False)
        == fmt.render(TOOL_CONVERSATION[:2], TOOLS, True) + written + "<|im_end|>\n"
    )


def test_streamed_reasoning_and_content() -> None:
    stream = chat_format("qwen3").streaming_parser()
    text = "<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 5.<|im_end|>"
    parts = [stream.feed_parts(ch) for ch in text]
    reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
    parsed, rest = stream.finish()
    assert reasoning == "Step one.\nStep two." == parsed.reasoning_content
    assert content == "The answer is 5." and rest == ""


TEXTS = [
    '<think>\nhm </thi </think>\n\nok <tool_call>{"name": "a", "arguments": {}}</tool_call><|im_end|>',
    "plain <tool_ text <|im_e and <|im_end|>",
    '  {"name": "add", "parameters": {"a": 1}}<|eot_id|>',
    "Hello {x} <|python_tag|> world<|eot_id|>",
    "<think>never closed\n\n",
    "I add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "hm </think>\n\nok\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>",
    '<|channel>thought\nhm <channel|>ok <|tool_call>call:f{a:<|"|>x,}<|"|>}<tool_call|><turn|>',
    '[add(a=1, b="x"), ns.f()]<|eot_id|>',
    "[not a call<|eot_id|>",
]
RULES = [
    chat_format("qwen3").rules,
    CompletionRules(HermesParser(), ("<|im_end|>",)),
    CompletionRules(Llama3JsonParser(), ("<|eot_id|>", "<|eom_id|>")),
    CompletionRules(HermesParser(), ("<|im_end|>",), THINK, True),
    CompletionRules(XmlToolParser(), ("<|im_end|>",), THINK, True),
    CompletionRules(Gemma4ToolParser(), ("<turn|>",), GEMMA4_THINK),
    CompletionRules(PythonicToolParser(), ("<|eot_id|>",)),
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.sampled_from(RULES), st.lists(st.integers(0, 80), max_size=8))
def test_streaming_releases_prefixes_of_the_final_parse(
    text: str, rules: CompletionRules, cuts: list[int]
) -> None:
    stream = CompletionStream(rules)
    bounds = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    start, reasoning, content = 0, "", ""
    for end in bounds:
        r, c = stream.feed_parts(text[start:end])
        reasoning, content, start = reasoning + r, content + c, end
        assert (rules.parse(text).reasoning_content or "").startswith(reasoning)
        assert rules.parse(text).content.startswith(content)
    parsed, rest = stream.finish()
    assert content + rest == parsed.content
    assert reasoning + stream.reasoning_rest(parsed) == (parsed.reasoning_content or "")


def test_pythonic_calls() -> None:
    """Llama 3.2's pythonic calls, in the `pythonic` format and through `llama3_json`, whole and streamed."""
    text = '[get_weather(city="Zürich", days=2), add(a=1, b=-2.5, flags=[True, None], opts={"k": "v"})]'
    expected = [("get_weather", {"city": "Zürich", "days": 2}),
                ("add", {"a": 1, "b": -2.5, "flags": [True, None], "opts": {"k": "v"}})]  # fmt: skip
    for parser in (PythonicToolParser(), Llama3JsonParser()):
        parsed = parser.parse(text)
        assert parsed.content == ""
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
        ] == expected
    rules = CompletionRules(PythonicToolParser(), ("<|eot_id|>",))
    stream = CompletionStream(rules)
    assert "".join(stream.feed(ch) for ch in text + "<|eot_id|>") == ""  # nothing of the call leaks as text
    assert len(stream.finish()[0].tool_calls) == 2
    wrapped = PythonicToolParser().parse("<|python_start|>[f(x=1)]<|python_end|>")
    assert wrapped.tool_calls[0]["function"]["arguments"] == '{"x": 1}'
    for not_calls in ("[1, 2]", "[f(1)]", "[f(x=open('a'))]", "The list [f(x=1)] is code.", "[f(**k)]"):
        assert PythonicToolParser().parse(not_calls).content == not_calls
    assert chat_format("llama3_2").parse(text + "<|eot_id|>").tool_calls[1]["function"]["name"] == "add"
