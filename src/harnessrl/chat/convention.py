"""Tools for a model whose own chat template has no tool support (Gemma 3, Llama 3.0). Pure functions.

The conversation is rewritten into messages such a template can render, and the template then renders
them with its own rules (Gemma 3: the system text opens the first user turn, roles alternate):

- the tool schemas join the system message (`# Tools` block, as in `chatml.tools_block`), or become
  a system message of their own when the conversation has none;
- an assistant message with `tool_calls` becomes text: its content followed by one
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call (parsed back by `hermes`);
- tool results become a user turn, each result as `<tool_response>\\n{content}\\n</tool_response>`
  (Qwen's own layout); consecutive user turns (results, then the user's next words) are joined with a
  newline, so user and assistant turns still alternate.
"""

from __future__ import annotations

from typing import Any

from harnessrl.chat.chatml import ChatFormatError, content_text, render_tool_call, tools_block


def _assistant_text(msg: dict[str, Any], i: int) -> str:
    text = content_text(msg.get("content"), where=f"messages[{i}].content")
    for j, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.name must be a string")
        text += render_tool_call(fn["name"], fn.get("arguments", {}))
    return text


def _as_user(msg: dict[str, Any], i: int) -> str:
    text = content_text(msg.get("content"), where=f"messages[{i}].content")
    if msg.get("role") == "tool":
        return f"<tool_response>\n{text}\n</tool_response>"
    return text


def fold_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages with tools, tool calls and tool results written as text (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role in ("user", "tool"):
            text = _as_user(msg, i)
            if out and out[-1]["role"] == "user" and (role == "tool" or out[-1].get("_tool")):
                out[-1]["content"] += "\n" + text
                out[-1]["_tool"] = out[-1].get("_tool") or role == "tool"
            else:
                out.append({"role": "user", "content": text, "_tool": role == "tool"})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg, i)})
        elif role in ("system", "developer"):
            out.append(
                {"role": "system", "content": content_text(msg.get("content"), f"messages[{i}].content")}
            )
        else:
            raise ChatFormatError(f"messages[{i}].role must be one of system, user, assistant, tool")
    for m in out:
        m.pop("_tool", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
