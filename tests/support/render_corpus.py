"""Conversations as OpenAI clients send them, for the render differential against vLLM (pure data, no imports
from harnessrl: bench/record_vllm_renders.py reads it from vLLM's own venv).

Tool round trips, parallel calls, content parts, unicode arguments (escaped and raw), system prompts in
several places (system, developer, late system), tools without a description or parameters, malformed
arguments, reasoning sent back, and a named user."""

from __future__ import annotations

from typing import Any

ADD = {
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
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
}  # no description
PING = {"type": "function", "function": {"name": "ping"}}  # neither description nor parameters
DATE = {"date_string": "26 Jul 2024"}  # Llama 3.2 writes today's date otherwise


def _call(i: int, name: str, args: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def _calls(*calls: dict[str, Any], content: Any = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def _tool(i: int, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": content}


USER = {"role": "user", "content": "What is 2+3?"}
CASES: list[dict[str, Any]] = [
    {"name": "plain", "tools": None, "messages": [
        {"role": "system", "content": "You are terse."}, USER]},
    {"name": "multi_turn", "tools": None, "messages": [
        USER, {"role": "assistant", "content": "5."}, {"role": "user", "content": "And 5+5?"}]},
    {"name": "tool_round_trip", "tools": [ADD], "messages": [
        {"role": "system", "content": "Use the tools."}, USER, _calls(_call(0, "add", '{"a": 2, "b": 3}')),
        _tool(0, "5"), {"role": "assistant", "content": "2+3 is 5."}, {"role": "user", "content": "Thanks!"}]},
    {"name": "parallel_calls", "tools": [ADD, NOTE], "messages": [
        USER, _calls(_call(0, "add", '{"a": 2, "b": 3}'), _call(1, "note", '{"text": "adding"}'), content="On it."),
        _tool(0, "5"), _tool(1, "saved")]},
    {"name": "content_parts", "tools": [ADD], "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be exact."}, {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "2 and 3."}]},
        _calls(_call(0, "add", '{"a": 2, "b": 3}'), content=[{"type": "text", "text": ""}]),
        _tool(0, [{"type": "text", "text": "5"}, {"type": "text", "text": "(exact)"}]),
        {"role": "assistant", "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": "5."}]},
        {"role": "user", "content": [{"type": "text", "text": "ok"}]}]},
    {"name": "unicode_arguments", "tools": [NOTE], "messages": [
        {"role": "user", "content": "Note: Größe 😀 ü"},
        _calls(_call(0, "note", '{"text": "Gr\\u00f6\\u00dfe \\ud83d\\ude00 ü"}')), _tool(0, "gespeichert ✓")]},
    {"name": "developer_first", "tools": [ADD], "messages": [
        {"role": "developer", "content": "Developer rules."}, USER]},
    {"name": "late_system", "tools": None, "messages": [
        {"role": "system", "content": "First."}, USER, {"role": "assistant", "content": "5."},
        {"role": "system", "content": "Now be brief."}, {"role": "user", "content": "3+4?"}]},
    {"name": "developer_late", "tools": None, "messages": [
        {"role": "system", "content": "First."}, USER, {"role": "assistant", "content": "5."},
        {"role": "developer", "content": "Later rule."}, {"role": "user", "content": "3+4?"}]},
    {"name": "tools_without_description", "tools": [NOTE, PING], "messages": [USER]},
    {"name": "malformed_arguments", "tools": [ADD], "messages": [
        USER, _calls(_call(0, "add", '{"a": 2,'), _call(1, "add", ""), _call(2, "add", "[1, 2]")),
        _tool(0, "error"), _tool(1, "error"), _tool(2, "error")]},
    {"name": "reasoning_sent_back", "tools": [ADD], "messages": [
        USER, {"role": "assistant", "content": "5.", "reasoning": "2 plus 3.", "reasoning_content": "ignored"},
        {"role": "user", "content": "And 5+5?"},
        {"role": "assistant", "content": "10.", "reasoning": "5 plus 5.", "reasoning_content": "not read"}]},
    {"name": "named_user_empty_content", "tools": None, "messages": [
        {"role": "user", "content": "", "name": "alice"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "hi"}]},
]  # fmt: skip


def has_tools(case: dict[str, Any]) -> bool:
    """Whether the case offers tools, calls one or sends a tool result (folded for templates without tools)."""
    return bool(case["tools"]) or any(m.get("tool_calls") or m["role"] == "tool" for m in case["messages"])
