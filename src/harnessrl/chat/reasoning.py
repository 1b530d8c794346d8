"""Reasoning models' thinking text before the answer: `<think>...</think>` (Qwen3, Qwen3.5) or
`<|channel>thought\\n...<channel|>` (Gemma 4). Pure functions.

Qwen3 writes `<think>\\n{reasoning}\\n</think>\\n\\n{content}` when thinking is on; with the template's
`enable_thinking=false` the generation prompt already holds an empty `<think>\\n\\n</think>\\n\\n` and the
completion is plain content. The split mirrors how Qwen3's template renders an assistant turn back
(`reasoning.strip('\\n')`, `content.lstrip('\\n')`), so the parts re-render to the text the model wrote.
`started` is for templates whose generation prompt itself opens the block (Qwen3.5: the completion
begins inside the thinking and only `</think>` is generated). `call_open` is the tool-call opener of the
family's format: a call that starts before the block is closed (Qwen3.5 does so) ends the thinking there,
and the rest (without a later closing marker) is parsed for calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from harnessrl.chat.markers import partial_tail


@dataclass(frozen=True)
class ThinkTags:
    """The markers around a completion's thinking text (`label`: a word right after the opener that is
    not part of the thinking, Gemma 4's `thought`)."""

    open: str = "<think>"
    close: str = "</think>"
    label: str = ""


THINK = ThinkTags()
GEMMA4_THINK = ThinkTags("<|channel>", "<channel|>", "thought")


def _thinking_body(text: str, tags: ThinkTags, started: bool) -> str | None:
    """The text after the opening marker (and its label), or None when the completion does not think."""
    if started:
        body = text
    else:
        lead = text.lstrip()
        if not lead.startswith(tags.open):
            return None
        body = lead[len(tags.open) :]
    if tags.label and body.startswith(tags.label):
        return body[len(tags.label) :]
    if tags.label and tags.label.startswith(body):
        return ""  # the label is still being generated
    return body


def _end_of_thinking(body: str, tags: ThinkTags, call_open: str | None) -> tuple[int, int] | None:
    """Where the thinking ends in `body` and where the content begins, or None while it is open."""
    end = body.find(tags.close)
    call = body.find(call_open) if call_open else -1
    if call >= 0 and (end < 0 or call < end):
        return call, call
    return (end, end + len(tags.close)) if end >= 0 else None


def _content_after(body: str, at: int, tags: ThinkTags, call_open: str | None) -> str:
    rest = body[at:]
    if call_open and rest.startswith(call_open):
        return rest.replace(tags.close, "", 1)  # a call inside the thinking: its late closing marker goes
    return rest.lstrip("\n")


def split_reasoning(
    text: str, tags: ThinkTags = THINK, started: bool = False, call_open: str | None = None
) -> tuple[str | None, str]:
    """(reasoning, content) of a whole completion; reasoning is None when it has no thinking block,
    and all of an unclosed block (a completion cut inside its thinking) is reasoning."""
    body = _thinking_body(text, tags, started)
    if body is None:
        return None, text
    bounds = _end_of_thinking(body, tags, call_open)
    if bounds is None:
        return body.strip("\n"), ""
    return body[: bounds[0]].strip("\n"), _content_after(body, bounds[1], tags, call_open)


def reasoning_progress(
    text: str, tags: ThinkTags = THINK, started: bool = False, call_open: str | None = None
) -> tuple[str, str | None]:
    """For a completion still being generated: the reasoning that is final so far, and the content so far
    (None while the thinking block may still be open or may still begin). Both are prefixes of what
    `split_reasoning` gives for any continuation of `text`."""
    if not started:
        lead = text.lstrip()
        if not lead.startswith(tags.open):
            return ("", None) if tags.open.startswith(lead) else ("", text)
    body = _thinking_body(text, tags, started)
    assert body is not None
    bounds = _end_of_thinking(body, tags, call_open)
    if bounds is None:
        held = max(partial_tail(body, tags.close), partial_tail(body, call_open) if call_open else 0)
        return body[: len(body) - held].strip("\n"), None
    return body[: bounds[0]].strip("\n"), _content_after(body, bounds[1], tags, call_open)
