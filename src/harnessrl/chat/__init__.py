"""Chat: rendering prompts and parsing completions (tool calls) for the models harnessrl serves.

`chatml`: the ChatML convention for models whose own template has no tool support (SmolLM2).
"""

from __future__ import annotations

from harnessrl.chat.chatml import (
    SMOLLM2,
    ChatFormatError,
    ChatTemplate,
    ParsedCompletion,
    StreamingParser,
    content_text,
    generation_prompt,
    new_tool_call_id,
    normalize_message,
    parse_completion,
    render_chat,
    render_tool_call,
    render_turn,
    tool_call_parts,
    tools_block,
)

__all__ = [
    "SMOLLM2",
    "ChatFormatError",
    "ChatTemplate",
    "ParsedCompletion",
    "StreamingParser",
    "content_text",
    "generation_prompt",
    "new_tool_call_id",
    "normalize_message",
    "parse_completion",
    "render_chat",
    "render_tool_call",
    "render_turn",
    "tool_call_parts",
    "tools_block",
]
