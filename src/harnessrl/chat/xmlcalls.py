"""Qwen3.5 / Qwen3-Coder tool calls: XML-style blocks inside `<tool_call>`. Pure functions.

The template (tests/fixtures/chat_templates/qwen3_5.jinja) asks the model for

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

and renders a call's arguments back so: a string as it is, an object or a list as JSON, anything else
with Python's `str` (`2`, `2.5`, `True`). Parsing reverses it: a parameter's text without the newline the
template writes on each side, converted by the type the request's tool schema gives that parameter
(`string` stays text; `integer`, `number`, `boolean`, `null`; `object`/`array` as JSON), and where no
schema names it, a JSON value other than a string when the text is one (`2`, `true`, `[1]`), else text.
Text around the blocks is content; a block without `<function=...>` stays in the content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from harnessrl.chat.chatml import ParsedCompletion, openai_tool_call
from harnessrl.chat.markers import opener_hold

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_TEXT_TYPES = ("string", "str", "text")


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each offered function's parameter schemas by function name (from OpenAI-shaped tools)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _schema_type(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for (see the module docstring)."""
    kind = _schema_type(schema)
    if kind in _TEXT_TYPES:
        return text
    if text.strip() in ("null", "None") and kind is not None:
        return None
    try:
        if kind == "integer":
            return int(text.strip())
        if kind == "number":
            number = float(text.strip())
            return (
                int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
            )
    except ValueError:
        return text
    if kind == "boolean":
        low = text.strip().lower()
        return True if low == "true" else False if low == "false" else text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) and kind is None else value


def _strip_one_newline(text: str) -> str:
    if text.startswith("\n"):
        text = text[1:]
    return text[:-1] if text.endswith("\n") else text


def parse_function_block(body: str, schemas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The OpenAI tool call of one `<function=NAME>...</function>` block, or None when it has none."""
    found = _FUNCTION.search(body)
    if found is None:
        return None
    name = found.group(1).strip()
    props = schemas.get(name, {})
    args = {}
    for p in _PARAMETER.finditer(found.group(2)):
        key = p.group(1).strip()
        args[key] = convert_value(_strip_one_newline(p.group(2)), props.get(key))
    return openai_tool_call(name, args)


@dataclass(frozen=True)
class XmlToolParser:
    """Qwen3.5 / Qwen3-Coder `<tool_call><function=...><parameter=...>` blocks."""

    name: str = "qwen3_coder"
    open: str = "<tool_call>"
    close: str = "</tool_call>"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Content with the well-formed blocks cut out, and their calls in order (a last block cut off
        before `</tool_call>` counts once its `</function>` is there)."""
        schemas = tool_schemas(tools)
        parts: list[str] = []
        calls: list[dict[str, Any]] = []
        pos = search = 0
        while (start := text.find(self.open, search)) >= 0:
            end = text.find(self.close, start + len(self.open))
            stop = end + len(self.close) if end >= 0 else len(text)
            body = text[start + len(self.open) : end if end >= 0 else len(text)]
            if end < 0 and "</function>" not in body:
                break
            search = stop
            call = parse_function_block(body, schemas)
            if call is None:
                continue  # not a call: it remains part of the content
            parts.append(text[pos:start])
            calls.append(call)
            pos = stop
        parts.append(text[pos:])
        return ParsedCompletion(content="".join(parts), tool_calls=calls)

    def hold(self, text: str) -> tuple[int, bool]:
        """Content up to the first `<tool_call>` (then blocked), or all but a tail that may become one."""
        return opener_hold(text, self.open)
