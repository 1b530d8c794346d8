"""Reading the engine's answers: pure functions from an answer (or its stream events) to what the gateway
records — the exact token IDs, their logprobs, the text and tool calls, the finish reason. An answer that
lacks what must be recorded raises `BadUpstreamResponse`, here and nowhere else.

Shapes read (vLLM's OpenAI server with `return_token_ids`, which the builtin engine speaks too): a chat
answer's `choices[0].message` with `logprobs.content[].logprob`; a completion's `choices[0].text` with
`logprobs.token_logprobs`; `prompt_token_ids` at the top level or (vLLM's /v1/completions) in the choice.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from harnessrl.gateway.canonical import TokenRecord


class BadUpstreamResponse(ValueError):
    """The engine's answer lacks the token IDs or logprobs the gateway must record."""


MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError)  # what reading a bad answer raises


def token_ids(values: Any) -> list[int]:
    """`values` as a list of token IDs. A JSON array of integers, as engines send them, is checked in C
    (an `array` of int64 is built and dropped) and kept as it is: a third of the cost of converting each
    ID, which is per prompt token on every call (issue 35). Anything else is converted one by one, as
    `int()` does (an ID sent as `3.0` or `"3"`); what cannot be is a `MALFORMED` error."""
    if type(values) is list:
        try:
            array("q", values)
            return values
        except (TypeError, OverflowError):
            pass
    return [int(t) for t in values]


@contextlib.contextmanager
def reading(what: str) -> Iterator[None]:
    """Turn the errors of reading a malformed answer into `BadUpstreamResponse` naming `what`."""
    try:
        yield
    except BadUpstreamResponse:
        raise
    except MALFORMED as e:
        raise BadUpstreamResponse(f"{what}: {e!r}") from e


def finish_reason(tool_calls: list[Any], record: TokenRecord) -> str:
    """The finish reason a client is given: `tool_calls` when the answer calls tools."""
    return "tool_calls" if tool_calls else (record.finish_reason or "stop")


@dataclass(frozen=True)
class ChatAnswer:
    """A non-streamed chat answer, read."""

    record: TokenRecord
    text: str
    tool_calls: list[dict[str, Any]]
    token_texts: list[str]
    reasoning: str | None = None  # `reasoning_content` (vLLM, the builtin engine) or `reasoning`


@dataclass(frozen=True)
class CompletionAnswer:
    """A non-streamed completion answer, read."""

    record: TokenRecord
    text: str
    token_texts: list[str]


def read_chat(resp: dict[str, Any]) -> ChatAnswer:
    """`/v1/chat/completions` with token IDs and logprobs."""
    with reading("engine answer lacks token ids or logprobs"):
        choice = resp["choices"][0]
        message = choice["message"]
        content = (choice.get("logprobs") or {}).get("content") or []
        record = TokenRecord(
            prompt_ids=token_ids(resp["prompt_token_ids"]),
            completion_ids=token_ids(choice["token_ids"]),
            completion_logprobs=[float(c["logprob"]) for c in content],
            finish_reason=choice.get("finish_reason"),
            weight_version=version(resp),
        )
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        answer = ChatAnswer(record, message.get("content") or "", list(message.get("tool_calls") or []),
                            [str(c.get("token", "")) for c in content],
                            reasoning if isinstance(reasoning, str) else None)  # fmt: skip
    check_lengths(record)
    return answer


def read_completion(resp: dict[str, Any], need_text: bool = False) -> CompletionAnswer:
    """`/v1/completions` with token IDs and logprobs (`need_text`: the text must be there too)."""
    with reading("engine answer lacks token ids, text or logprobs" if need_text else
                 "engine answer lacks token ids or logprobs"):  # fmt: skip
        choice = resp["choices"][0]
        lp = choice.get("logprobs") or {}
        record = TokenRecord(
            prompt_ids=prompt_ids(resp, choice),
            completion_ids=token_ids(choice["token_ids"]),
            completion_logprobs=[float(x) for x in lp.get("token_logprobs") or []],
            finish_reason=choice.get("finish_reason"),
            weight_version=version(resp),
        )
        text = str(choice["text"]) if need_text else str(choice.get("text") or "")
        answer = CompletionAnswer(record, text, [str(t) for t in lp.get("tokens") or []])
    check_lengths(record)
    return answer


def prompt_ids(resp: dict[str, Any], choice: dict[str, Any]) -> list[int]:
    """A completions answer's prompt token IDs: top level (chat; the builtin engine) or, as vLLM's
    `/v1/completions` sends them, in the choice."""
    ids = resp.get("prompt_token_ids")
    if ids is None:
        ids = choice["prompt_token_ids"]
    return token_ids(ids)


def version(resp: dict[str, Any]) -> int | None:
    """The weight version an answer (or stream event) says served it, if it says."""
    v = resp.get("weight_version")
    return int(v) if isinstance(v, int) else None


def cached_tokens(resp: dict[str, Any]) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an engine answer (vLLM and ours), if present."""
    n = ((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return n if isinstance(n, int) and n >= 0 else None


def stop_string(choice: dict[str, Any]) -> str | None:
    """The stop string that ended the completion, if any (vLLM's `stop_reason` holds it)."""
    reason = choice.get("stop_reason")
    return reason if isinstance(reason, str) else None


def check_lengths(record: TokenRecord) -> None:
    """Every completion token has its logprob."""
    if len(record.completion_logprobs) != len(record.completion_ids):
        raise BadUpstreamResponse(
            f"engine sent {len(record.completion_ids)} completion tokens but "
            f"{len(record.completion_logprobs)} logprobs"
        )


def check_prompt(record: TokenRecord, sent: list[int]) -> None:
    """The engine used the prompt token IDs the gateway sent (tito)."""
    if record.prompt_ids != sent:
        raise BadUpstreamResponse("the engine reports prompt token ids other than those the gateway sent")


class Accumulator:
    """Collects token IDs and logprobs from stream events (vLLM's shape with `return_token_ids`)."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.texts: list[str] = []
        self.finish: str | None = None
        self.stop: str | None = None
        self.version: int | None = None
        self.cached: int | None = None  # prompt tokens from the engine's prefix cache, if its usage says

    def take(self, event: dict[str, Any]) -> dict[str, Any]:
        """Absorb one event's token data; return its first choice (raises `MALFORMED` errors)."""
        choice: dict[str, Any] = (event.get("choices") or [{}])[0]
        if (cached := cached_tokens(event)) is not None:  # the last chunk's usage (vLLM: with include_usage)
            self.cached = cached
        first = event.get("prompt_token_ids") or choice.get("prompt_token_ids")  # vLLM: in the choice
        if first is not None and self.prompt_ids is None:
            self.prompt_ids = token_ids(first)
        if isinstance(event.get("weight_version"), int):
            self.version = int(event["weight_version"])
        self.ids += [int(t) for t in choice.get("token_ids") or []]
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.stop = stop_string(choice)
        return choice

    def take_completion(self, event: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Absorb a `/v1/completions` stream event: its first choice and text piece."""
        with reading("the engine sent a malformed stream event"):
            choice = self.take(event)
            lp = choice.get("logprobs") or {}
            self.logprobs += [float(x) for x in lp.get("token_logprobs") or []]
            self.texts += [str(t) for t in lp.get("tokens") or []]
            return choice, str(choice.get("text") or "")

    def record(self) -> TokenRecord:
        """The call's token record; raises if the stream lacked token IDs or logprobs."""
        if self.prompt_ids is None:
            raise BadUpstreamResponse("the engine's stream carried no prompt_token_ids")
        record = TokenRecord(self.prompt_ids, self.ids, self.logprobs, self.finish, self.version)
        check_lengths(record)
        return record

    def partial(self) -> TokenRecord:
        """The token record of a stream cut short: the tokens that came with their logprobs."""
        n = min(len(self.ids), len(self.logprobs))
        return TokenRecord(
            list(self.prompt_ids or []), self.ids[:n], self.logprobs[:n], "cancelled", self.version
        )
