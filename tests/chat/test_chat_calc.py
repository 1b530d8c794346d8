"""Chat rendering against the model's own template, tool-call parsing, and the calc example's parts."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.chat import ChatFormatError, parse_completion, render_chat, render_tool_call
from harnessrl.controller.runner import AttemptResult
from harnessrl.examples.calc.harness import CalcError, evaluate, final_number, format_number, run_tool
from harnessrl.examples.calc.task import build_splits, grade
from harnessrl.schema import Task

text = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="<>"), max_size=40)


def hf_template(model_dir: Path) -> jinja2.Template:
    return jinja2.Environment().from_string((model_dir / "chat_template.jinja").read_text())


@settings(max_examples=100, deadline=None)
@given(st.booleans(), st.lists(text, min_size=1, max_size=5))
def test_render_matches_the_models_own_template(
    tiny_model_dir: Path, with_system: bool, turns: list[str]
) -> None:
    msgs = [{"role": "system", "content": "be brief"}] if with_system else []
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    ours = render_chat(msgs, add_generation_prompt=True)
    theirs = hf_template(tiny_model_dir).render(messages=msgs, add_generation_prompt=True)
    assert ours == theirs


@settings(max_examples=100, deadline=None)
@given(
    text,
    st.lists(
        st.tuples(
            st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
            st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), st.integers() | text, max_size=3),
        ),
        max_size=3,
    ),
)
def test_tool_calls_round_trip_through_render_and_parse(content: str, calls: list[tuple[str, dict]]) -> None:  # type: ignore[type-arg]
    generated = content + "".join(render_tool_call(n, a) for n, a in calls) + "<|im_end|>"
    parsed = parse_completion(generated)
    assert parsed.content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ] == calls
    # an assistant message carrying these calls renders back to exactly the generated text
    msg = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    rendered = render_chat([{"role": "system", "content": "s"}, msg], add_generation_prompt=False)
    assert rendered.endswith(f"<|im_start|>assistant\n{generated}\n")


def test_malformed_tool_calls_stay_text_and_bad_messages_are_named() -> None:
    parsed = parse_completion('<tool_call>{"name": oops}</tool_call> done')
    assert parsed.tool_calls == [] and parsed.content.startswith("<tool_call>")
    with pytest.raises(ChatFormatError, match=r"messages\[1\].role"):
        render_chat([{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}])
    with pytest.raises(ChatFormatError, match=r"tools\[0\]"):
        render_chat([{"role": "user", "content": "x"}], tools=[{"type": "function"}])


def test_tools_are_described_in_the_system_turn() -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    out = render_chat([{"role": "user", "content": "hi"}], tools=tools)
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '"name": "calculator"' in out and "<tool_call>" in out
    tool_turn = render_chat([{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}])
    assert "<|im_start|>tool\n42<|im_end|>\n" in tool_turn


def test_calculator() -> None:
    assert evaluate("12 + 7 * 3") == 33
    assert format_number(evaluate("7 / 2")) == "3.5" and format_number(evaluate("-4 * 2")) == "-8"
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1", "a" * 300):
        with pytest.raises(CalcError):
            evaluate(bad)
    assert run_tool("calculator", '{"expression": "2+2"}') == "4"
    assert run_tool("calculator", "not json").startswith("error:")
    assert run_tool("shell", "{}").startswith("error: unknown tool")
    assert final_number("The answer is -12.5.") == "-12.5" and final_number("no idea") is None


def _result(tmp_path: Path, answer: object) -> AttemptResult:
    out = tmp_path / "output"
    out.mkdir(exist_ok=True)
    if answer is not None:
        (out / "answer.json").write_text(json.dumps({"answer": answer, "tool_calls": 1}))
    return AttemptResult(exit_code=0, timed_out=False, output_dir=out, stdout_tail="", stderr_tail="")


def test_grader_on_known_good_and_bad_answers(tmp_path: Path) -> None:
    task = Task(task_id="t", input={"question": "What is 2 + 3?"}, reference={"answer": "5"})
    assert grade(task, _result(tmp_path, "5")).value == 1.0
    assert grade(task, _result(tmp_path, "5.0")).value == 1.0
    assert grade(task, _result(tmp_path, "6")).value == 0.0
    assert grade(task, _result(tmp_path, "five")).value == 0.0
    (tmp_path / "output" / "answer.json").unlink()
    assert grade(task, _result(tmp_path, None)).value == 0.0


def test_splits_are_disjoint_and_deterministic() -> None:
    train, held = build_splits(300, 50, seed=0)
    _train2, held2 = build_splits(300, 50, seed=0)
    assert [t.input for t in held] == [t.input for t in held2] and len(held) == 50
    assert not {t.input["question"] for t in train} & {t.input["question"] for t in held}
    assert all("answer" not in t.input for t in train + held)  # the harness never sees the answer


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "Hi ",
                "<",
                "tool",
                "_call",
                ">",
                '{"name": "f", "arguments": {}}',
                "</tool_call>",
                "<tool_ca",
                "ll>",
                "x",
                "<|im_end|>",
                " done",
            ]
        ),
        max_size=12,
    ),
    st.data(),
)
def test_streamed_content_is_a_prefix_and_nothing_is_lost(pieces: list[str], data: st.DataObject) -> None:
    from harnessrl.chat import StreamingParser

    text = "".join(pieces)
    # split the same text at random points, as a token stream would
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parser = StreamingParser()
    streamed = "".join(parser.feed(d) for d in deltas)
    parsed, rest = parser.finish()
    assert streamed + rest == parsed.content == parse_completion(text).content
    assert "<tool_call>" not in streamed
