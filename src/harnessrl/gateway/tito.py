"""Token in, token out: the gateway builds the prompt's token IDs itself. Pure functions.

When the new messages extend an earlier call of the rollout — that call's messages, then the answer
the harness received — the prompt starts with that call's exact `prompt_ids + completion_ids`, and
only the new turns are rendered and tokenized. A call whose text was cut by a stop string is never
reused this way: its tokens hold text the harness did not receive, so the conversation is rendered. So a merged row holds exactly the tokens the model
saw and sampled, however the harness echoed the answer back (parsed tool calls, re-serialised JSON).

For ChatML models the boundary is clean: a turn ends with the special token `<|im_end|>`, after
which the rendered text continues with `\\n` and the next turn, and no BPE merge crosses a special
token, so tokenizing the suffix alone gives the same IDs as tokenizing the whole text.

Any other family (a `ChatFormat` rendering the model's own template) has the same boundary at its own
end-of-turn token (`<|eot_id|>`, `<end_of_turn>`, ...): the new text is what the whole conversation
renders to after as many end-of-turn markers as the covered messages render, so a template that
renders earlier turns differently once the conversation goes on (Qwen3 drops old thinking) still
extends the model's exact tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.chat import (
    SMOLLM2,
    ChatFormat,
    ChatTemplate,
    generation_prompt,
    normalize_message,
    render_chat,
    render_turn,
)
from harnessrl.schema import Call, CallStatus

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class TitoPrompt:
    """The prompt's token IDs and which earlier call (if any) they extend."""

    prompt_ids: list[int]
    extends_call: str | None = None
    reused_tokens: int = 0


def tools_key(tools: Any) -> str:
    """A canonical form of a request's tools, to tell whether two calls render the same system turn."""
    return json.dumps(tools or [], sort_keys=True)


def find_extended_call(
    messages: Sequence[dict[str, Any]], tools: Any, history: Sequence[Call]
) -> tuple[Call, int] | None:
    """The most recent call whose messages + answer are a prefix of `messages` (same tools), and how
    many messages that prefix covers."""
    norm = [normalize_message(m) for m in messages]
    key = tools_key(tools)
    for call in reversed(history):
        if call.status != CallStatus.OK or not call.completion_ids or (call.chat or {}).get("stopped_by"):
            continue  # a stop string cut the text: the harness never saw all of these tokens
        prev, prev_tools, answer = call.conversation()
        if answer is None or not prev or tools_key(prev_tools) != key:
            continue
        covered = len(prev) + 1
        if covered <= len(norm) and norm[:covered] == [
            *map(normalize_message, prev),
            normalize_message(answer),
        ]:
            return call, covered
    return None


def build_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    history: Sequence[Call],
    encode: Encode,
    eos_id: int,
    template: ChatTemplate = SMOLLM2,
    chat: ChatFormat | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> TitoPrompt:
    """Prompt IDs for `messages`: an earlier call's exact tokens plus the rendered new turns, or the
    whole conversation rendered and tokenized when it extends no earlier call. `chat`: the model's
    own chat format (None or a `chatml` one: the ChatML convention of `template`), rendered with
    `template_kwargs` (the call's own template variables, over the run's)."""
    if chat is not None and chat.renderer != "chatml":
        return _build_with_format(messages, tools, history, encode, chat, template_kwargs or {})
    template = chat.chatml if chat is not None else template  # the folder's ChatML (system prompt or none)
    found = find_extended_call(messages, tools, history)
    if found is None:
        return TitoPrompt(encode(render_chat(messages, tools=tools, template=template)))
    call, covered = found
    ids = list(call.prompt_ids) + list(call.completion_ids)
    reused = len(ids)
    if call.completion_ids[-1] != eos_id:  # the answer was cut short: close its turn as rendering would
        ids += encode(template.im_end)
    rest = "".join(render_turn(m, covered + i, template) for i, m in enumerate(messages[covered:]))
    ids += encode("\n" + rest + generation_prompt(template))
    return TitoPrompt(ids, extends_call=call.call_id, reused_tokens=reused)


def _build_with_format(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    history: Sequence[Call],
    encode: Encode,
    chat: ChatFormat,
    kwargs: dict[str, Any],
) -> TitoPrompt:
    """`build_prompt` for a model's own template: the new text starts after the end-of-turn marker
    that closes the extended call's answer in the rendering of the whole conversation."""
    full = chat.render(messages, tools, **kwargs)
    found = find_extended_call(messages, tools, history)
    if found is None:
        return TitoPrompt(encode(full))
    call, covered = found
    turns = _count_markers(chat.render(messages[:covered], tools, False, **kwargs), chat)
    cut = _after_marker(full, chat, turns)
    if cut is None:  # the template renders the covered turns with fewer markers: render it all
        return TitoPrompt(encode(full))
    ids = list(call.prompt_ids) + list(call.completion_ids)
    reused = len(ids)
    if call.completion_ids[-1] not in chat.stop_ids:  # cut short: close its turn as rendering would
        ids += encode(chat.rules.stop_texts[0])
    ids += encode(full[cut:])
    return TitoPrompt(ids, extends_call=call.call_id, reused_tokens=reused)


def _marker_positions(text: str, chat: ChatFormat) -> list[int]:
    """End offsets of the end-of-turn markers in `text`, in order."""
    stops = [s for s in chat.rules.stop_texts if s]
    if not stops:
        return []
    pattern = re.compile("|".join(re.escape(s) for s in sorted(stops, key=len, reverse=True)))
    return [m.end() for m in pattern.finditer(text)]


def _count_markers(text: str, chat: ChatFormat) -> int:
    return len(_marker_positions(text, chat))


def _after_marker(text: str, chat: ChatFormat, n: int) -> int | None:
    """The offset just after the n-th end-of-turn marker of `text` (None when it has fewer)."""
    ends = _marker_positions(text, chat)
    return ends[n - 1] if 0 < n <= len(ends) else None
