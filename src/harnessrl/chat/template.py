"""A model folder's own chat template, rendered with jinja2 the way transformers renders it.

transformers' `apply_chat_template(..., tokenize=False)` compiles the template in an immutable sandboxed
jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and its
`{% generation %}` block (rendered as its body), a `tojson`
filter that does not escape HTML (`json.dumps` with `ensure_ascii=False`), and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`; it renders with `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, `eos_token`,
`unk_token`, `pad_token`, ...) and any extra template kwargs (Qwen3's `enable_thinking`). Messages lose
their keys whose value is None first, and a message's reasoning is also offered as `reasoning_content`
and `thinking`. `JinjaTemplate` does the same, so a prompt rendered here is byte-identical to
transformers' for the same messages, tools and kwargs (tests/chat/test_template.py checks it per family).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from harnessrl.chat.chatml import ChatFormatError

# the named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker): templates mark the
    assistant's text with it for `return_assistant_tokens_mask`; for prompt text the block renders its
    body unchanged, as in transformers."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads it from the class)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        """The block's body, kept as it is."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _TemplateDict:
    """`dict(...)` inside a template, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        """`dict.fromkeys` for templates."""
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the namespace attribute {name!r}"
            )


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationBlocks]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatFormatError(f"chat_template does not compile (line {e.lineno}): {e.message}") from e


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a template sees them: None-valued keys dropped, reasoning under all its names."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with a 'role'")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@dataclass(frozen=True)
class JinjaTemplate:
    """A chat template and the special tokens it is rendered with."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @cached_property
    def compiled(self) -> jinja2.Template:
        """The compiled template (compiled once, on first use)."""
        return compile_template(self.source)

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads the `tools` variable (else tools must be folded into text)."""
        return "tools" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages (and tools, and template kwargs such as `enable_thinking`) into prompt text."""
        if not isinstance(messages, list) or not messages:
            raise ChatFormatError("messages must be a non-empty list")
        context = {**self.special_tokens, **kwargs}
        try:
            return self.compiled.render(
                messages=template_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatFormatError(f"messages: the model's chat template refused them: {e}") from e


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json of a model folder ({} when absent)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def template_source(folder: Path, config: dict[str, Any] | None = None) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or the entry named `default` of a list of named templates); None when it has none."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = (read_tokenizer_config(folder) if config is None else config).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def neutral_special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens of a folder's tokenizer_config.json (for a template harnessrl supplies)."""
    config = read_tokenizer_config(folder)
    return {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}


def load_template(folder: str | Path) -> JinjaTemplate | None:
    """The folder's own chat template with its special tokens, or None when the folder has none."""
    folder = Path(folder)
    config = read_tokenizer_config(folder)
    source = template_source(folder, config)
    if source is None:
        return None
    special = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
    }
    return JinjaTemplate(source, special)
