"""Shared conversations for the chat tests: a multi-turn tool conversation in HF and in OpenAI shape."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any


def tokenizers_dir() -> Path:
    """Where `make install` unpacks the real tokenizers (the Makefile's TOKENIZER_DIR rule): $HARNESSRL_TOKENIZERS,
    else $XDG_CACHE_HOME/harnessrl/tokenizers when XDG_CACHE_HOME is an absolute path, else the checkout's
    .cache/tokenizers."""
    env = os.environ.get("HARNESSRL_TOKENIZERS")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "harnessrl" / "tokenizers"
    return Path(__file__).resolve().parents[2] / ".cache" / "tokenizers"


TOKENIZERS = tokenizers_dir()
FAMILIES = ("qwen3", "qwen2_5", "llama3", "llama3_2", "gemma3")
NATIVE_TOOLS = ("qwen3", "qwen2_5", "llama3_2")  # templates that read `tools`
FOLDED = ("llama3", "gemma3")  # templates without tools: tools are written as text first

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]

# the HF convention: tool-call arguments as an object, content "" beside tool calls
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a calculator. Use the tools."},
    {"role": "user", "content": "What is 2+3? Größe: ü"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "assistant", "content": "2+3 is 5."},
    {"role": "user", "content": "Thanks! And 5+5?"},
]


def openai_shaped(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as the OpenAI SDK sends it: content None beside tool calls, arguments as
    a JSON string, `developer` for the system role."""
    out = copy.deepcopy(messages)
    for m in out:
        if m["role"] == "system":
            m["role"] = "developer"
        for call in m.get("tool_calls") or []:
            m["content"] = None
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def tokenizer_dir(family: str) -> Path:
    """The real tokenizer folder of a family (made by the Makefile's tokenizers target)."""
    folder = TOKENIZERS / family
    if not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{folder} is missing: run `make install` (the $(TOKENIZERS) target)")
    return folder
