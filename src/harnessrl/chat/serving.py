"""Messages and tools as vLLM's OpenAI server hands them to a chat template (vLLM 0.32). Pure functions.

A model trained here is served later by vLLM; for the same request both must render the same prompt. What
vLLM does before `apply_chat_template` (its `parse_chat_messages`, `_postprocess_messages` and
`safe_apply_chat_template`), re-implemented from its documented behaviour and source:

- **content**: a string is one text part, `null` is no part; parts of type `text`, `input_text`,
  `output_text`, `refusal` and `thinking` are text (a part whose text is `null` is skipped). A template
  that iterates over a message's content (the "openai" content format, detected from the template: Gemma
  3, Qwen3.5) gets a list of parts as the list of `{"type": "text", "text": ...}` parts; any other
  template gets the texts joined with a newline (`""` for none). A `tool` message's parts are always
  joined with a newline. Other parts (images, audio) are refused: harnessrl serves text models.
  One deviation: vLLM also turns a *string* into a one-part list for such templates; here a string
  stays a string. The two render alike for Gemma 3 and Qwen3.5, but llama.cpp's Gemma 4 template writes
  a list system prompt as its Python repr (and Gemma 3's fails on an empty one), so vLLM's way would
  train on a broken prompt.
- **system**: a leading `x-anthropic-billing-header` line (Claude Code's per-request attribution) is
  dropped from system text parts.
- **assistant**: `tool_calls` kept (an empty list is dropped), each call's `arguments` given to the
  template as an object: an object stays, a JSON string is decoded, anything else (invalid JSON, a JSON
  value that is not an object, `null`, `""`) becomes `{}`; `reasoning` is passed as both `reasoning`
  and `reasoning_content`. vLLM 0.32 reads only `reasoning` (the field it answers with); the gateway
  answers with `reasoning_content`, so that is read when `reasoning` is absent: a harness echoing each
  server's own field gets the same prompt from both.
- **tool**: `tool_call_id` kept; **any role**: `name` when it is a string; other keys are not passed.
- **developer**: kept as `developer` (with its `tools`) when the template names that role; otherwise it
  becomes `system`, and then all system messages merge into one at the start, joined by a blank line.
- **tools**: `{"type": "function", "function": {"name", "description", "parameters"}}` with `null` for a
  missing description or parameters (vLLM's pydantic `model_dump`), `strict`/`defer_loading` only when set.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.nodes

from harnessrl.chat.chatml import ChatFormatError

TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "thinking")
BILLING_HEADER = "x-anthropic-billing-header"


# content format: does the template loop over a message's content? ------------------------------------
def _names_of(node: jinja2.nodes.Node, var: str) -> bool:
    """`var`, `var[...]` or `var.attr` (a slice or item of it)."""
    while isinstance(node, jinja2.nodes.Getitem | jinja2.nodes.Getattr | jinja2.nodes.Filter):
        node = node.node  # type: ignore[assignment]
    return isinstance(node, jinja2.nodes.Name) and node.name == var


def _content_of(node: jinja2.nodes.Node, var: str) -> bool:
    """`var.content` or `var['content']`."""
    if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
        return _names_of(node.node, var)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == "content" and _names_of(node.node, var)
    return False


def _aliases(root: jinja2.nodes.Template, var: str) -> set[str]:
    """`var` and the names assigned from it (`{% set loop_messages = messages[1:] %}`), transitively."""
    names = {var}
    changed = True
    while changed:
        changed = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            fresh = isinstance(target, jinja2.nodes.Name) and target.name not in names
            if fresh and any(_names_of(assign.node, n) for n in names):
                names.add(target.name)  # type: ignore[attr-defined]
                changed = True
    return names


def _message_vars(root: jinja2.nodes.Template) -> set[str]:
    out = set()
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(
            _names_of(loop.iter, n) for n in _aliases(root, "messages")
        ):
            out.add(loop.target.name)
    return out | {"message"}


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    msgs = _message_vars(root)
    in_macros: dict[int, set[str]] = {}
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [a.name for a in macro.args]
        bound = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args[: len(params)]):
                    if any(_content_of(arg, m) for m in msgs):
                        bound.add(params[i])
                for kw in call.kwargs:
                    if kw.key in params and any(_content_of(kw.value, m) for m in msgs):
                        bound.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros[id(loop)] = bound
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_content_of(it, m) for m in msgs):
            yield loop
        elif isinstance(it, jinja2.nodes.Name):
            bound_params = in_macros.get(id(loop))  # a loop inside a macro: over a parameter given content
            if (bound_params is not None and it.name in bound_params) or (
                bound_params is None and it.name == "content"
            ):
                yield loop


@lru_cache(maxsize=32)
def content_format(source: str) -> str:
    """`openai` when the template loops over a message's content parts, else `string` (vLLM's detection)."""
    from harnessrl.chat.template import compile_template

    try:
        root = compile_template(source).environment.parse(source)
    except (jinja2.TemplateError, ChatFormatError):
        return "string"
    return "openai" if next(_content_loops(root), None) is not None else "string"


# messages --------------------------------------------------------------------------------------------
def _texts(content: Any, role: str, where: str) -> list[str]:
    if content is None:
        return []
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ChatFormatError(f"{where} must be a string, null or a list of text parts")
    out = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") in TEXT_PARTS:
            kind = part["type"]
            text = part.get(kind if kind in ("thinking", "refusal") else "text")
        else:
            raise ChatFormatError(f"{where}[{i}] must be a text part; only text content is supported")
        if not text:
            continue  # vLLM drops empty and null text parts
        if not isinstance(text, str):
            raise ChatFormatError(f"{where}[{i}].text must be a string")
        if role == "system" and text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise ChatFormatError(f"{where}[{j}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"{where}[{j}].function.name must be a string")
        out.append({**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}})
    return out


def _message(m: Any, i: int, fmt: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ChatFormatError(f"messages[{i}] must be an object with a string 'role'")
    role = m["role"]
    texts = _texts(m.get("content"), role, f"messages[{i}].content")
    as_parts = fmt == "openai" and not isinstance(m.get("content"), str)
    content: Any = [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            calls = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if calls:
                out["tool_calls"] = calls
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")  # the gateway answers with this name (see the docstring)
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        out["content"] = "\n".join(texts)
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _merge_systems(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems = [(i, m) for i, m in enumerate(conversation) if m["role"] == "system"]
    if not systems or (len(systems) == 1 and systems[0][0] == 0):
        return conversation
    texts = []
    for _, m in systems:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    rest = [m for m in conversation if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def server_messages(messages: Any, source: str) -> list[dict[str, Any]]:
    """The conversation vLLM's OpenAI server renders for these request messages with this template."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    fmt = content_format(source)
    out = [_message(m, i, fmt) for i, m in enumerate(messages)]
    if any(m["role"] == "developer" for m in out) and not (
        '"developer"' in source or "'developer'" in source
    ):
        out = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer"
               else m for m in out]  # fmt: skip
        out = _merge_systems(out)
    return out


def server_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Request tools as vLLM passes them to the template (`null` for a missing description/parameters)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        spec = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        spec.update({k: fn[k] for k in ("strict", "defer_loading") if fn.get(k) is not None})
        entry: dict[str, Any] = {"type": "function", "function": spec}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
            spec.setdefault("defer_loading", tool["defer_loading"])
        out.append(entry)
    return out
