"""Reasoning models' thinking text: `<think>...</think>` before the answer (Qwen3). Pure functions.

Qwen3 writes `<think>\\n{reasoning}\\n</think>\\n\\n{content}` when thinking is on; with the template's
`enable_thinking=false` the generation prompt already holds an empty `<think>\\n\\n</think>\\n\\n` and the
completion is plain content. The split mirrors how Qwen3's template renders an assistant turn back
(`reasoning.strip('\\n')`, `content.lstrip('\\n')`), so the parts re-render to the text the model wrote.
`started` is for templates whose generation prompt itself opens the block (the completion then begins
inside the thinking).
"""

from __future__ import annotations

from dataclasses import dataclass

from harnessrl.chat.toolcalls import partial_tail


@dataclass(frozen=True)
class ThinkTags:
    """The markers around a completion's thinking text."""

    open: str = "<think>"
    close: str = "</think>"


THINK = ThinkTags()


def _thinking_body(text: str, tags: ThinkTags, started: bool) -> str | None:
    """The text after the opening marker, or None when the completion does not think."""
    if started:
        return text
    lead = text.lstrip()
    if lead.startswith(tags.open):
        return lead[len(tags.open) :]
    return None


def split_reasoning(text: str, tags: ThinkTags = THINK, started: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole completion; reasoning is None when it has no thinking block,
    and all of an unclosed block (a completion cut inside its thinking) is reasoning."""
    body = _thinking_body(text, tags, started)
    if body is None:
        return None, text
    end = body.find(tags.close)
    if end < 0:
        return body.strip("\n"), ""
    return body[:end].strip("\n"), body[end + len(tags.close) :].lstrip("\n")


def reasoning_progress(text: str, tags: ThinkTags = THINK, started: bool = False) -> tuple[str, str | None]:
    """For a completion still being generated: the reasoning that is final so far, and the content so far
    (None while the thinking block may still be open or may still begin). Both are prefixes of what
    `split_reasoning` gives for any continuation of `text`."""
    if not started:
        lead = text.lstrip()
        if not lead.startswith(tags.open):
            return ("", None) if tags.open.startswith(lead) else ("", text)
    body = _thinking_body(text, tags, started)
    assert body is not None
    end = body.find(tags.close)
    if end < 0:
        safe = body[: len(body) - partial_tail(body, tags.close)]
        return safe.strip("\n"), None
    return body[:end].strip("\n"), body[end + len(tags.close) :].lstrip("\n")
