"""Token in, token out: prompts reuse the exact tokens of earlier calls; rollouts merge into one row."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from openai import OpenAI

from harnessrl.adapter import merge_calls
from harnessrl.chat import render_chat
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.tito import build_prompt
from harnessrl.schema import Call, CallStatus
from tests.support.gateway import GatewayHandle

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def test_prompt_extends_the_exact_tokens_even_when_the_answer_is_echoed_differently(
    tiny_model_dir: Path,
) -> None:
    tok = TitoTokenizer.from_dir(str(tiny_model_dir))
    first = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 1+2?"}]
    prompt_ids = tok.encode(render_chat(first, tools=TOOLS))
    generated = ' Let me see.<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>'
    completion_ids = [*tok.encode(generated), tok.eos_id]
    answer = {"role": "assistant", "content": " Let me see.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"1+2"}'}}]}  # fmt: skip
    prev = Call(call_id="c0", rollout_id="r", attempt=0, created_at=0, latency_s=0, status=CallStatus.OK,
                model="m", upstream="u", request={"messages": first, "tools": TOOLS},
                response={"choices": [{"message": answer}]}, prompt_ids=prompt_ids,
                completion_ids=completion_ids, completion_logprobs=[-1.0] * len(completion_ids))  # fmt: skip
    # the SDK echoes the message back with re-serialised arguments and extra keys
    echoed = {**answer, "refusal": None, "tool_calls": [{**answer["tool_calls"][0], "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "1+2"})}}]}  # fmt: skip
    nxt = [*first, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    built = build_prompt(nxt, TOOLS, [prev], tok.encode, tok.eos_id)
    assert (
        built.extends_call == "c0"
        and built.prompt_ids[: len(prompt_ids) + len(completion_ids)] == prompt_ids + completion_ids
    )
    tail = tok.tokenizer.decode(
        built.prompt_ids[len(prompt_ids) + len(completion_ids) :], skip_special_tokens=False
    )
    assert tail == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    # re-rendering the whole conversation would not reproduce the sampled tokens (spacing of the JSON)
    rendered = tok.encode(render_chat(nxt, tools=TOOLS))
    assert rendered[: len(prompt_ids) + len(completion_ids)] != prompt_ids + completion_ids
    # a call whose text a stop string cut is not extended: its tokens hold text the harness never got
    cut = prev.model_copy(
        update={"chat": {"messages": first, "tools": TOOLS, "answer": answer, "stopped_by": "}"}}
    )
    assert build_prompt(nxt, TOOLS, [cut], tok.encode, tok.eos_id).extends_call is None
    # with different tools the earlier call is not extended
    assert build_prompt(nxt, None, [prev], tok.encode, tok.eos_id).extends_call is None


def conversation(gw: GatewayHandle, key: str, turns: int) -> None:
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": "Chat."},
        {"role": "user", "content": "Hello there!"},
    ]  # type: ignore[type-arg]
    for i in range(turns):
        resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=12)  # type: ignore[arg-type]
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": f"Turn {i}: go on, with 'quotes' and  spaces."})


def test_tito_rollouts_merge_into_one_row(
    make_gateway: Callable[..., GatewayHandle], tiny_model_dir: Path
) -> None:
    gw = make_gateway(mode="tito", tokenizer_path=str(tiny_model_dir))
    tok = TitoTokenizer.from_dir(str(tiny_model_dir))
    rids = []
    for _ in range(3):
        rid, key = gw.new_rollout(sampling={"temperature": 1.0})
        conversation(gw, key, turns=4)
        rids.append(rid)
    for rid in rids:
        calls = gw.store.calls(rid)
        assert len(calls) == 4 and all(c.status == CallStatus.OK for c in calls)
        first = calls[0]
        assert first.prompt_ids == tok.encode(render_chat(first.request["messages"], tools=TOOLS))
        result = merge_calls(calls)
        assert len(result.rows) == 1 and result.breaks == []
        # the text the model saw is the rendered conversation, except for its own sampled tokens
        row = result.rows[0]
        assert sum(row.loss_mask) == sum(len(c.completion_ids) for c in calls)
