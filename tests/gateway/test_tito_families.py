"""Token in, token out for every family's own template: a 3-call tool rollout built with the real
tokenizers extends each earlier call's exact tokens and merges into one row without breaks."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from harnessrl.adapter import merge_calls
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.tito import build_prompt
from harnessrl.schema import Call, CallStatus
from tests.support.conversations import FAMILIES, TOOL_CONVERSATION, TOOLS, tokenizer_dir

# what a model of each family writes for the tool call and for the answer (its end-of-turn marker last)
WRITTEN = {
    "qwen3": ('<think>\nI add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
              "<think>\n\n</think>\n\n2+3 is 5.<|im_end|>"),
    "qwen2_5": ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>', "2+3 is 5.<|im_end|>"),
    "llama3_2": ('{"name": "add", "parameters": {"a": 2, "b": 3}}<|eom_id|>', "2+3 is 5.<|eot_id|>"),
    "llama3": ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|eot_id|>', "2+3 is 5.<|eot_id|>"),
    "gemma3": ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><end_of_turn>', "2+3 is 5.<end_of_turn>"),
}  # fmt: skip


@cache
def tito_tokenizer(family: str) -> TitoTokenizer:
    """The gateway's tokenizer and chat format for the family's folder."""
    return TitoTokenizer.from_dir(str(tokenizer_dir(family)))


def _call(
    i: int, messages: list[dict[str, Any]], prompt: list[int], completion: list[int], answer: dict[str, Any]
) -> Call:
    return Call(call_id=f"c{i}", rollout_id="r", attempt=0, created_at=i, latency_s=0, status=CallStatus.OK,
                model="m", upstream="u", request={"messages": messages, "tools": TOOLS},
                response={"choices": [{"message": answer}]}, prompt_ids=prompt, completion_ids=completion,
                completion_logprobs=[-1.0] * len(completion))  # fmt: skip


def _answer(tok: TitoTokenizer, text: str) -> dict[str, Any]:
    """The message the harness receives (OpenAI shape), parsed in the family's format."""
    parsed = tok.chat.parse(text)
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": parsed.tool_calls or None}


@pytest.mark.parametrize("family", FAMILIES)
def test_three_call_rollout_merges_into_one_row(family: str) -> None:
    tok = tito_tokenizer(family)
    first = TOOL_CONVERSATION[:2]
    calls: list[Call] = []
    messages = list(first)
    follow_ups = [
        {"role": "tool", "tool_call_id": "x", "content": "5"},
        {"role": "user", "content": "Thanks!"},
    ]
    for i, written in enumerate([*WRITTEN[family], "You're welcome."]):
        built = build_prompt(messages, TOOLS, calls, tok.encode, tok.eos_id, chat=tok.chat)
        if calls:
            prev = calls[-1]
            assert built.extends_call == prev.call_id, (family, i)
            assert built.prompt_ids[: built.reused_tokens] == prev.prompt_ids + prev.completion_ids
        completion = tok.encode(written)
        assert completion[-1] in tok.stop_ids or i == 2  # the turn ends with the family's stop token
        answer = _answer(tok, written)
        if i == 0:
            answer["tool_calls"][0]["id"] = "x"
            assert answer["tool_calls"][0]["function"]["name"] == "add"
        calls.append(_call(i, list(messages), built.prompt_ids, completion, answer))
        messages += [{k: v for k, v in answer.items() if v is not None}, *follow_ups[i : i + 1]]
    result = merge_calls(calls)
    assert len(result.rows) == 1 and result.breaks == []
    assert sum(result.rows[0].loss_mask) == sum(len(c.completion_ids) for c in calls)


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_2", "gemma3"])
def test_extension_equals_a_fresh_rendering_where_the_template_is_prefix_stable(family: str) -> None:
    tok = tito_tokenizer(family)
    first = TOOL_CONVERSATION[:2]
    kw = {"date_string": "26 Jul 2024"}
    prompt = tok.encode(tok.chat.render(first, TOOLS, **kw))
    completion = tok.encode(WRITTEN[family][0])
    answer = _answer(tok, WRITTEN[family][0])
    prev = _call(0, first, prompt, completion, answer)
    nxt = [*first, {k: v for k, v in answer.items() if v is not None}, {"role": "tool", "content": "5"}]
    built = build_prompt(nxt, TOOLS, [prev], tok.encode, tok.eos_id, chat=tok.chat)
    if family == "llama3_2":  # the model ended its tool call with <|eom_id|>; the template writes <|eot_id|>
        completion = [*completion[:-1], tok.tokenizer.token_to_id("<|eot_id|>")]
        built.prompt_ids[len(prompt) + len(completion) - 1] = completion[-1]
    assert built.prompt_ids == tok.encode(tok.chat.render(nxt, TOOLS, **kw))
