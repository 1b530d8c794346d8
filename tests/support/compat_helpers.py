"""Checks shared by the real-client compatibility tests."""

from __future__ import annotations

from pathlib import Path

from harnessrl.chat import render_tool_call
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.schema import Call, CallStatus


def answer_text(call: Call) -> str:
    """The text the model generated, as the harness received it (content + its tool calls re-rendered)."""
    _, _, answer = call.conversation()
    if answer is None:
        return str((call.response or {})["choices"][0]["text"])
    text = answer.get("content") or ""
    for tc in answer.get("tool_calls") or []:
        text += render_tool_call(tc["function"]["name"], tc["function"]["arguments"])
    return str(text)


def assert_tokens_match_answers(calls: list[Call], model_dir: Path) -> None:
    """Every call was recorded with token IDs, and its completion IDs decode to what the client got."""
    tok = TitoTokenizer.from_dir(str(model_dir))
    assert calls, "no call was recorded"
    for call in calls:
        assert call.status == CallStatus.OK and call.prompt_ids and call.completion_ids
        assert len(call.completion_ids) == len(call.completion_logprobs)
        # Special tokens (the end of turn, or one the random tiny model samples mid-text) are not shown.
        decoded = tok.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        stop = (call.chat or {}).get("stopped_by")
        if stop is None:
            assert decoded == answer_text(call), (decoded, answer_text(call))
        else:  # the client got the text up to the stop string; the tokens go on to complete it
            assert decoded.startswith(answer_text(call)) and stop in decoded[len(answer_text(call)) :]
