"""The output budget against the model's context, as a gateway in front of a small model must keep it.

Harnesses ask for budgets sized for their usual models (Claude Code: `max_tokens` 32,000 to 128,000)
whatever the context of the model served here. So a call whose `max_tokens` exceeds what the prompt
leaves of the context is served with the budget clamped to the remainder (and the call record says
so: `max_tokens_clamped`); a *prompt* that leaves no room at all gets the API's own error
(`errors.context_too_long`), which harnesses know how to handle (compaction, retry).

The context length comes from the engine (`max_model_len` of its `/tokenize` answer, as the builtin
engine and vLLM report it), asked once per served model. The prompt is counted only when it might not
fit: a byte-level BPE token is at least one byte, so a rendered prompt of B bytes has at most B tokens,
and B + max_tokens within the context needs no count. Otherwise it is counted exactly: in tito mode
with the very token IDs the gateway will send, in passthrough mode by the engine's `/tokenize`.
An engine that reports no context length leaves budgets as the harness asked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.chat import ChatFormatError, render_chat
from harnessrl.gateway.canonical import ChatCall, Sampling
from harnessrl.gateway.engine_client.inference import TitoTokenizer, tito_prompt
from harnessrl.gateway.engine_client.upstream import StickyUpstream, UpstreamClientError, UpstreamFailed
from harnessrl.gateway.errors import APIError, context_too_long
from harnessrl.schema import Call

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fit:
    """The sampling a call is served with, and the clamp applied (None when the budget fit)."""

    sampling: Sampling
    clamped: dict[str, int] | None = None


def clamp(prompt_tokens: int, sampling: Sampling, context: int, style: str, param: str = "messages") -> Fit:
    """Fit `sampling.max_tokens` into what `prompt_tokens` leave of `context`; a prompt that leaves no
    room for one token is the API's 400."""
    if prompt_tokens >= context:
        raise context_too_long(prompt_tokens, context, style, param)
    room = context - prompt_tokens
    if sampling.max_tokens <= room:
        return Fit(sampling)
    clamped = {
        "requested": sampling.max_tokens,
        "served": room,
        "prompt_tokens": prompt_tokens,
        "context": context,
    }
    return Fit(dataclasses.replace(sampling, max_tokens=room), clamped)


class ContextBudget:
    """Knows the served models' context lengths and fits each call's output budget into them."""

    def __init__(self, tito: TitoTokenizer | None) -> None:
        self.tito = tito
        self._contexts: dict[str, int | None] = {}

    async def context(self, up: StickyUpstream, served: str) -> int | None:
        """The served model's context length, asked of the engine once (None when it does not say)."""
        if served in self._contexts:
            return self._contexts[served]
        try:
            resp = await up.post("/tokenize", {"model": served, "prompt": "a"})
        except UpstreamFailed:
            return None  # the engine is unreachable now: ask again next time
        except UpstreamClientError as e:
            resp = {}
            log.info("event=context_unknown model=%s reason=%r", served, e.message)
        value = resp.get("max_model_len")
        self._contexts[served] = value if isinstance(value, int) and value > 0 else None
        return self._contexts[served]

    async def count(
        self, up: StickyUpstream, served: str, chat: ChatCall, history: Sequence[Call]
    ) -> int | None:
        """The prompt's exact token count: the tito prompt's IDs, or the engine's `/tokenize` (None when
        its answer has no count; an engine that fails raises `UpstreamFailed`)."""
        try:
            if self.tito is not None:
                return len(tito_prompt(chat, self.tito, history).prompt_ids)
            body: dict[str, Any] = {"model": served, "messages": chat.messages, "add_generation_prompt": True}
            if chat.tools:
                body["tools"] = chat.tools
            if chat.template_kwargs:
                body["chat_template_kwargs"] = chat.template_kwargs
            count = (await up.post("/tokenize", body)).get("count")
        except ChatFormatError as e:
            raise APIError(400, str(e)) from None
        except UpstreamClientError as e:  # the engine says the prompt itself is invalid: the client's fault
            raise APIError(400, f"the engine rejected the prompt: {e.message}") from None
        return count if isinstance(count, int) else None

    async def fit(self, up: StickyUpstream, served: str, chat: ChatCall, sampling: Sampling,
                  history: Sequence[Call], style: str, param: str = "messages") -> Fit:  # fmt: skip
        """The call's sampling with `max_tokens` fitted into the context (see the module docstring)."""
        context = await self.context(up, served)
        if context is None:
            return Fit(sampling)
        try:
            render = self.tito.chat.render if self.tito is not None else render_chat  # passthrough: ChatML's
            kwargs = (chat.template_kwargs or {}) if self.tito is not None else {}
            upper_bound = len(render(chat.messages, chat.tools, **kwargs).encode())
        except ChatFormatError as e:
            raise APIError(400, str(e)) from None
        if upper_bound + sampling.max_tokens <= context:
            return Fit(sampling)
        try:
            n = await self.count(up, served, chat, history)
        except UpstreamFailed as e:  # the call itself fails over, or fails and is recorded
            log.info("event=count_failed model=%s error=%r", served, str(e))
            return Fit(sampling)
        return Fit(sampling) if n is None else clamp(n, sampling, context, style, param)
