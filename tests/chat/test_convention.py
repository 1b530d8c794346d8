"""The convention for templates without tools keeps Gemma 3's rule (user and model turns alternate) for
any tool conversation, checked by Gemma 3's real template itself; and its parts parse back."""

from __future__ import annotations

import itertools
import json
from functools import cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.chat import ChatFormat
from harnessrl.chat.convention import fold_tools
from tests.support.conversations import TOOLS, tokenizer_dir


@cache
def gemma() -> ChatFormat:
    """Gemma 3's chat format (its real template)."""
    return ChatFormat.from_folder(tokenizer_dir("gemma3"))


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def tool_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Optional system; then user, assistant (maybe calling tools, whose results follow) ... ."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for turn in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(TEXT)})
        while True:
            n_calls = draw(st.integers(0, 2))
            calls = [{"id": f"c{turn}{k}", "type": "function",
                      "function": {"name": "add", "arguments": json.dumps({"a": draw(st.integers())})}}
                     for k in range(n_calls)]  # fmt: skip
            messages.append({"role": "assistant", "content": draw(TEXT), "tool_calls": calls or None})
            if not calls:
                break
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": draw(TEXT)} for c in calls]
            if draw(st.booleans()):
                break  # the conversation goes on with the user's next words after the results
    return messages


@settings(max_examples=60, deadline=None)
@given(tool_conversations(), st.booleans())
def test_gemma3_accepts_every_folded_tool_conversation(
    messages: list[dict[str, Any]], with_tools: bool
) -> None:
    folded = fold_tools(messages, TOOLS if with_tools else None)
    roles = [m["role"] for m in folded if m["role"] != "system"]
    assert all(a != b for a, b in itertools.pairwise(roles))  # alternating
    prompt = gemma().render(messages, TOOLS if with_tools else None)  # the real template raises otherwise
    n_results = sum(m["role"] == "tool" for m in messages)
    assert prompt.count("<tool_response>") == n_results
    assert prompt.endswith("<start_of_turn>model\n")


def test_assistant_turn_parses_back_to_its_calls() -> None:
    calls = [{"id": "a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
             {"id": "b", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]  # fmt: skip
    folded = fold_tools(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok ", "tool_calls": calls}], None
    )
    parsed = gemma().parse(folded[-1]["content"] + "<end_of_turn>")
    assert parsed.content == "ok " and [
        json.loads(c["function"]["arguments"]) for c in parsed.tool_calls
    ] == [
        {"a": 1},
        {"a": 2},
    ]
