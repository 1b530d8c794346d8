"""Chat: rendering prompts and parsing completions (tool calls) for the models harnessrl serves.

`format.ChatFormat` is the one interface: built from a model folder, it renders prompts with the folder's
own template (`template`), parses completions in the family's tool-call format (`toolcalls`), splits
thinking from content (`reasoning`), streams (`completion`) and knows the family's stop tokens.
`chatml`: the ChatML convention for models whose own template has no tool support (SmolLM2);
`convention`: tools written as text for other templates without tool support (Gemma 3, Llama 3.0).
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
from harnessrl.chat.completion import CompletionRules, CompletionStream
from harnessrl.chat.format import CHATML, ChatFormat, detect_tool_parser

__all__ = [
    "CHATML",
    "SMOLLM2",
    "ChatFormat",
    "ChatFormatError",
    "ChatTemplate",
    "CompletionRules",
    "CompletionStream",
    "ParsedCompletion",
    "StreamingParser",
    "content_text",
    "detect_tool_parser",
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
