"""Tools of every kind a client sends, as the function tools a local model can call. Pure functions.

The model only ever sees function tools (`{"type": "function", "function": {name, description,
parameters}}`); what the client offered is mapped onto them, and the model's calls are mapped back by
each face with the `ToolOrigin` of the name it called:

- Responses `namespace` (a group of tools): each member becomes a function named `namespace.member`;
  a call comes back as the member's call with its `namespace` field, as the client expects.
- `custom` / freeform tools (one text input, maybe a grammar): a function with one string parameter
  `input` (the grammar, if any, quoted in the description; it is not enforced); a call comes back as a
  `custom_tool_call` with that text.
- Hosted tools the *client* executes (`local_shell`, computer use, client-side `tool_search`) become
  functions with the action's fields as parameters; their calls come back as the hosted call items.
- Hosted tools the API provider executes (`web_search`, `file_search`, `code_interpreter`, MCP,
  image generation; Anthropic's server tools such as `web_search_20250305`) cannot run here: they are
  left out of the prompt and the drop is recorded.
- Anthropic's client tools (`bash_*`, `text_editor_*`, `computer_*`, `memory_*`) get their documented
  input schema; tools with `defer_loading` enter the prompt only once a `tool_reference` loaded them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from harnessrl.gateway.errors import APIError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.:-]{1,128}$")
_DATED = re.compile(r"^(?P<base>[a-z_]+?)_(?P<date>\d{8})$")

# Responses hosted tools the API provider runs (nothing here can run them)
SERVER_TOOLS = ("web_search", "file_search", "code_interpreter", "image_generation", "mcp")
# Anthropic server tools (by their type without the date)
ANTHROPIC_SERVER_TOOLS = ("web_search", "web_fetch", "code_execution", "tool_search_tool_regex",
                          "tool_search_tool_bm25", "mcp_toolset")  # fmt: skip


@dataclass(frozen=True)
class ToolOrigin:
    """What a model-facing function stands for: the client's tool kind, name and namespace."""

    kind: str  # function | custom | local_shell | computer | tool_search
    name: str
    namespace: str | None = None


@dataclass
class ToolMap:
    """The function tools of the prompt, where each came from, and what was left out."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    origins: dict[str, ToolOrigin] = field(default_factory=dict)
    dropped: list[dict[str, str]] = field(default_factory=list)  # {"type", "name", "reason"}
    deferred: dict[str, dict[str, Any]] = field(default_factory=dict)  # Anthropic defer_loading tools

    def add(
        self, name: str, description: str | None, parameters: dict[str, Any] | None, origin: ToolOrigin
    ) -> None:
        """Offer one function to the model (a description or parameters the client left out stay None,
        as vLLM passes them to the template)."""
        fn = {"name": name, "description": description, "parameters": parameters}
        self.functions.append({"type": "function", "function": fn})
        self.origins[name] = origin

    def drop(self, kind: str, name: str, reason: str) -> None:
        """Record a tool left out of the prompt."""
        self.dropped.append({"type": kind, "name": name, "reason": reason})

    def origin(self, model_name: str) -> ToolOrigin:
        """The origin of a function the model called (a plain function when it offered none such)."""
        found = self.origins.get(model_name)
        if found is not None:
            return found
        namespace, dot, member = model_name.partition(".")
        return (
            ToolOrigin("function", member, namespace)
            if dot and member
            else ToolOrigin("function", model_name)
        )


def flat_name(namespace: str | None, name: str) -> str:
    """The model-facing name of a namespaced tool."""
    return f"{namespace}.{name}" if namespace else name


def custom_parameters() -> dict[str, Any]:
    """The parameters of a freeform tool seen as a function: one text `input`."""
    text = {"type": "string", "description": "The tool's input as raw text (not JSON-encoded)."}
    return {"type": "object", "properties": {"input": text}, "required": ["input"]}


def custom_description(tool: dict[str, Any]) -> str:
    """A freeform tool's description, with its grammar quoted (the grammar is not enforced)."""
    text = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") or "grammar"
        text += f"\n\nThe input must follow this {syntax} grammar:\n{fmt['definition']}"
    return text


def custom_input(arguments: str) -> str:
    """The text input of a freeform tool call from the arguments the model wrote."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return str(value["input"])
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
    return arguments


def arguments_object(arguments: str) -> dict[str, Any]:
    """The model's arguments as an object (`{"arguments": text}` when they are not one)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise APIError(
            400, f"{where}.name must be a tool name (letters, digits, _ - . :)", param=f"{where}.name"
        )
    return name


def _described(tool: dict[str, Any]) -> str | None:
    text = tool.get("description")
    return None if text is None else str(text)


def _given_schema(value: Any, where: str) -> dict[str, Any] | None:
    """The client's parameter schema, checked, or None when it sent none."""
    return None if value is None else _schema(value, where)


def _schema(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object"}
    if not isinstance(value, dict) or value.get("type", "object") != "object":
        raise APIError(400, f"{where} must be a JSON schema of type 'object'", param=where)
    return value


def _tool_list(tools: Any, where: str) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise APIError(400, f"{where} must be a list of tool objects", param=where)
    return tools


# OpenAI Responses ------------------------------------------------------------------------------------
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "argv of the command"},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["command"],
}
COMPUTER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"action": {"type": "object", "description": "one action: {type: click|double_click|drag|"
                                                              "keypress|move|screenshot|scroll|type|wait, ...}"}},
    "required": ["action"],
}  # fmt: skip


def _responses_member(out: ToolMap, tool: dict[str, Any], where: str, namespace: str | None) -> None:
    kind = tool.get("type", "function")
    name = _name(tool, where)
    model_name = flat_name(namespace, name)
    if kind == "function":
        params = _given_schema(tool.get("parameters"), f"{where}.parameters")
        out.add(model_name, _described(tool), params, ToolOrigin("function", name, namespace))
    elif kind == "custom":
        out.add(
            model_name, custom_description(tool), custom_parameters(), ToolOrigin("custom", name, namespace)
        )
    else:
        out.drop(str(kind), model_name, "only function and custom tools are supported inside a namespace")


def responses_tools(tools: Any, where: str = "tools") -> ToolMap:
    """The tool map of a Responses request's `tools`."""
    out = ToolMap()
    for i, tool in enumerate(_tool_list(tools, where)):
        kind, at = tool.get("type"), f"{where}.{i}"
        if kind in ("function", "custom"):
            _responses_member(out, tool, at, None)
        elif kind == "namespace":
            namespace = _name(tool, at)
            for j, member in enumerate(_tool_list(tool.get("tools"), f"{at}.tools")):
                _responses_member(out, member, f"{at}.tools.{j}", namespace)
        elif kind == "local_shell":
            out.add("local_shell", "Run a command on the user's machine.", LOCAL_SHELL_PARAMETERS,
                    ToolOrigin("local_shell", "local_shell"))  # fmt: skip
        elif kind in ("computer_use_preview", "computer_use", "computer"):
            out.add("computer", "Control the user's computer: one action per call.", COMPUTER_PARAMETERS,
                    ToolOrigin("computer", "computer"))  # fmt: skip
        elif kind == "tool_search" and tool.get("execution") == "client":
            params = _schema(tool.get("parameters"), f"{at}.parameters")
            out.add("tool_search", str(tool.get("description") or "Search for more tools."), params,
                    ToolOrigin("tool_search", "tool_search"))  # fmt: skip
        elif isinstance(kind, str) and (kind.startswith(SERVER_TOOLS) or kind == "tool_search"):
            out.drop(
                kind, str(tool.get("name") or kind), "hosted tool run by the API provider; not available here"
            )
        else:
            out.drop(str(kind), str(tool.get("name") or kind), "unsupported tool type")
    return out


# Anthropic -------------------------------------------------------------------------------------------
_EDITOR_FIELDS = {
    "path": {"type": "string"},
    "file_text": {"type": "string"},
    "old_str": {"type": "string"},
    "new_str": {"type": "string"},
    "insert_line": {"type": "integer"},
    "insert_text": {"type": "string"},
    "view_range": {"type": "array", "items": {"type": "integer"}},
}
ANTHROPIC_CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash": ("Run a command in a persistent bash shell.", {
        "type": "object", "required": ["command"],
        "properties": {"command": {"type": "string"}, "restart": {"type": "boolean"}}}),
    "text_editor": ("View and edit text files.", {
        "type": "object", "required": ["command", "path"],
        "properties": {"command": {"type": "string", "enum": ["view", "create", "str_replace", "insert",
                                                              "undo_edit"]}, **_EDITOR_FIELDS}}),
    "memory": ("Read and write files in the /memories directory.", {
        "type": "object", "required": ["command"],
        "properties": {"command": {"type": "string", "enum": ["view", "create", "str_replace", "insert",
                                                              "delete", "rename"]},
                       "old_path": {"type": "string"}, "new_path": {"type": "string"}, **_EDITOR_FIELDS}}),
    "computer": ("Control the computer's screen, mouse and keyboard: one action per call.", {
        "type": "object", "required": ["action"],
        "properties": {"action": {"type": "string"}, "coordinate": {"type": "array", "items": {"type": "integer"}},
                       "text": {"type": "string"}, "duration": {"type": "number"},
                       "scroll_direction": {"type": "string"}, "scroll_amount": {"type": "integer"}}}),
}  # fmt: skip


def _anthropic_custom(out: ToolMap, tool: dict[str, Any], where: str) -> None:
    name = _name(tool, where)
    if "input_schema" not in tool:
        raise APIError(400, f"{where}.input_schema: field required", param=f"{where}.input_schema")
    params = _schema(tool["input_schema"], f"{where}.input_schema")
    if tool.get("defer_loading") is True:
        out.deferred[name] = {"description": _described(tool), "parameters": params}
        return
    out.add(name, _described(tool), params, ToolOrigin("function", name))


def anthropic_tools(
    tools: Any, loaded: set[str] | frozenset[str] = frozenset(), where: str = "tools"
) -> ToolMap:
    """The tool map of a messages request's `tools` (`loaded`: deferred tools a tool_reference named)."""
    out = ToolMap()
    for i, tool in enumerate(_tool_list(tools, where)):
        kind, at = tool.get("type"), f"{where}.{i}"
        dated = _DATED.match(kind) if isinstance(kind, str) else None
        base = dated.group("base") if dated else None
        if kind in (None, "custom"):
            _anthropic_custom(out, tool, at)
        elif base is not None and base in ANTHROPIC_CLIENT_TOOLS:
            description, params = ANTHROPIC_CLIENT_TOOLS[base]
            name = _name(tool, at)
            out.add(name, description, params, ToolOrigin("function", name))
        elif base is not None and base in ANTHROPIC_SERVER_TOOLS:
            out.drop(
                str(kind),
                str(tool.get("name") or kind),
                "server tool run by the API provider; not available here",
            )
        else:
            out.drop(str(kind), str(tool.get("name") or kind), "unsupported tool type")
    for name, spec in out.deferred.items():
        if name in loaded:
            out.add(name, spec["description"], spec["parameters"], ToolOrigin("function", name))
        else:
            out.drop("deferred", name, "defer_loading and not loaded by a tool_reference yet")
    return out


# OpenAI chat completions -----------------------------------------------------------------------------
def chat_tools(tools: Any, where: str = "tools") -> ToolMap:
    """The tool map of a chat-completions request's `tools` (function tools kept, others dropped)."""
    out = ToolMap()
    for i, tool in enumerate(_tool_list(tools, where)):
        kind, at = tool.get("type"), f"{where}.{i}"
        fn = tool.get("function")
        if kind == "function" and isinstance(fn, dict):
            name = _name(fn, f"{at}.function")
            params = _given_schema(fn.get("parameters"), f"{at}.function.parameters")
            out.add(name, _described(fn), params, ToolOrigin("function", name))
        elif kind == "function":
            raise APIError(400, f"{at}.function: field required", param=f"{at}.function")
        else:
            custom = tool.get(str(kind)) if isinstance(kind, str) else None
            label = custom.get("name") if isinstance(custom, dict) else None
            out.drop(str(kind), str(label or kind), "only function tools are supported on chat completions")
    return out
