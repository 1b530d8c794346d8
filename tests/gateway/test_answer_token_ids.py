"""The engine answer reader's token IDs: a JSON array of integers is kept as sent (checked, not copied);
IDs an engine sends as floats or strings are converted as before; anything else is a bad answer."""

from __future__ import annotations

import orjson
import pytest

from harnessrl.gateway.engine_client.answers import BadUpstreamResponse, read_chat, read_completion, token_ids


def chat_answer(prompt_ids: object, ids: object) -> dict[str, object]:
    content = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1}]
    return orjson.loads(orjson.dumps({
        "prompt_token_ids": prompt_ids,
        "choices": [{"message": {"content": "ab"}, "token_ids": ids, "logprobs": {"content": content},
                     "finish_reason": "stop"}],
    }))  # fmt: skip


def test_integer_ids_are_kept_as_sent() -> None:
    resp = chat_answer(list(range(300)), [7, 2**40])
    answer = read_chat(resp)
    assert answer.record.prompt_ids is resp["prompt_token_ids"]  # checked in C, not copied
    assert answer.record.prompt_ids == list(range(300))
    assert answer.record.completion_ids == [7, 2**40]
    assert answer.record.completion_logprobs == [-0.5, -1.0]
    assert all(type(x) is float for x in answer.record.completion_logprobs)


def test_ids_sent_as_floats_or_strings_are_converted() -> None:
    assert token_ids([1.0, 2.0]) == [1, 2]
    assert token_ids(["3", 4]) == [3, 4]
    assert token_ids((5, 6)) == [5, 6]
    assert token_ids([2**70]) == [2**70]  # past int64: converted one by one, not refused
    answer = read_chat(chat_answer([1.0, 2], ["3", 4.0]))
    assert answer.record.prompt_ids == [1, 2] and answer.record.completion_ids == [3, 4]
    assert all(type(x) is int for x in answer.record.prompt_ids + answer.record.completion_ids)


@pytest.mark.parametrize("bad", [["x"], [None], None, [[1]], [{"id": 1}]])
def test_ids_that_are_not_numbers_are_a_bad_answer(bad: object) -> None:
    with pytest.raises(BadUpstreamResponse, match="token ids"):
        read_chat(chat_answer(bad, [1, 2]))
    completion = {"choices": [{"text": "x", "token_ids": bad, "prompt_token_ids": [1],
                               "logprobs": {"token_logprobs": [-1.0]}}]}  # fmt: skip
    with pytest.raises(BadUpstreamResponse):
        read_completion(completion)
