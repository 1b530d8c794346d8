"""The one internal form of a model call, whatever API face it arrived on. Pure data and functions.

Every face (OpenAI chat, Responses, Anthropic messages) translates its request into a `ChatCall`
(OpenAI-style messages and tools) and renders its answer from a `Generation`; the engine path
(passthrough or token-in-token-out) and the recording are the same code for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harnessrl.schema import SamplingOverrides


@dataclass
class ChatCall:
    """A chat request in canonical form: OpenAI chat messages and function tools, sampling params."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] | None = None  # chat template variables (`enable_thinking`), per call


@dataclass(frozen=True)
class Sampling:
    """The parameters the engine samples with, after the rollout's overrides."""

    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    stop: list[str] | None


def effective_sampling(call: ChatCall, overrides: SamplingOverrides, default_max_tokens: int) -> Sampling:
    """Harness parameters with the rollout's overrides applied (OpenAI's default temperature is 1.0)."""

    def pick(override: Any, own: Any, default: Any = None) -> Any:
        if override is not None:
            return override
        return own if own is not None else default

    return Sampling(
        max_tokens=pick(overrides.max_tokens, call.max_tokens, default_max_tokens),
        temperature=pick(overrides.temperature, call.temperature, 1.0),
        top_p=pick(overrides.top_p, call.top_p),
        seed=pick(overrides.seed, call.seed),
        stop=[*(call.stop or []), *(overrides.stop or [])] or None,
    )


@dataclass(frozen=True)
class TokenRecord:
    """What the engine says it consumed and produced."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    weight_version: int | None


@dataclass
class Generation:
    """The model's answer: text split into content and tool calls, plus the exact tokens."""

    content: str
    tool_calls: list[
        dict[str, Any]
    ]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments"}}
    finish_reason: str  # stop | length | tool_calls
    record: TokenRecord
    token_texts: list[str] = field(default_factory=list)  # text of each completion token (for logprobs)
    stopped_by: str | None = None  # the stop string that ended the text (the tokens then hold more text)
    cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache, if it said
    reasoning: str | None = (
        None  # a reasoning model's thinking text (Qwen3's <think>), split from the content
    )

    def answer_message(self) -> dict[str, Any]:
        """The answer as an OpenAI assistant message (what a harness appends to its history)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["content"] = self.content or None
            msg["tool_calls"] = self.tool_calls
        return msg

    @property
    def usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens)."""
        return len(self.record.prompt_ids), len(self.record.completion_ids)
