"""One model's chat format, built from its folder: render prompts, parse completions, stop tokens.

`ChatFormat.from_folder(path)` reads the folder's own chat template (chat_template.jinja or
tokenizer_config.json) and chooses, unless told (`engine.tool_parser`):

- how prompts are rendered: the template itself, with `tools`, when it supports tools (Qwen2.5, Qwen3,
  Llama 3.1+), fed the messages and tools as vLLM's OpenAI server feeds them (`serving`), so the prompt
  is the one vLLM renders for the same request; the template after `convention.fold_tools` when it has
  none (Gemma 3, Llama 3.0) and the conversation has tools;
  today's `chatml` convention for a ChatML template without tools (SmolLM2: same text, same tokens);
- how tool calls are parsed back: `qwen3_coder` when the template writes `<function=` (Qwen3.5,
  Qwen3-Coder), `gemma4` when it writes `<|tool_call>` (Gemma 4), `hermes` when it writes `<tool_call>`,
  `pythonic` when it asks for `[func_name(param=value)]`, `llama3_json` when it asks for
  `{"name": ..., "parameters": ...}`, `hermes` (the convention) when it has no tools;
- thinking: a template that knows `<think>` (or Gemma 4's `<|channel>`) gets its completions split into
  reasoning and content;
- end of turn: the family's markers that the template uses (`<|im_end|>`, `<|eot_id|>`/`<|eom_id|>`,
  `<end_of_turn>`, `<turn|>`), the tokenizer's eos and generation_config.json's `eos_token_id`, as ids.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harnessrl.chat.chatml import (
    SMOLLM2,
    ChatFormatError,
    ChatTemplate,
    ParsedCompletion,
    content_text,
    render_chat,
)
from harnessrl.chat.completion import CompletionRules, CompletionStream
from harnessrl.chat.convention import fold_tools
from harnessrl.chat.neutral import neutral_convention
from harnessrl.chat.reasoning import GEMMA4_THINK, THINK, ThinkTags
from harnessrl.chat.serving import server_messages, server_tools
from harnessrl.chat.template import (
    JinjaTemplate,
    load_template,
    neutral_special_tokens,
    read_tokenizer_config,
)
from harnessrl.chat.toolcalls import PYTHON_TAG, tool_parser

log = logging.getLogger(__name__)

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<turn|>")
PYTHONIC_HINT = "[func_name1(params_name1=params_value1"  # how pythonic templates ask for calls
RENDERERS = ("template", "folded", "chatml")


def detect_tool_parser(source: str | None) -> str:
    """The tool-call format a chat template teaches its model (`hermes` for templates without tools)."""
    if source is None:
        return "hermes"
    if "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if "<|tool_call>" in source:
        return "gemma4"
    if "<tool_call>" in source:
        return "hermes"
    if PYTHONIC_HINT in source:
        return "pythonic"
    if "tools" in source and ('"parameters"' in source or PYTHON_TAG in source or "ipython" in source):
        return "llama3_json"
    return "hermes"


def detect_think(source: str | None) -> ThinkTags | None:
    """The thinking markers a template knows (Gemma 4's channel, `<think>`), or None."""
    if source is None:
        return None
    if GEMMA4_THINK.open in source and GEMMA4_THINK.close in source:
        return GEMMA4_THINK
    return THINK if THINK.open in source else None


def detect_renderer(template: JinjaTemplate | None) -> str:
    """`template` (native tools), `folded` (tools written as text first) or `chatml` (SmolLM2's convention)."""
    if template is None:
        return "chatml"
    if template.supports_tools:
        return "template"
    return "chatml" if "<|im_start|>" in template.source else "folded"


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def canonical_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template: text content, `developer` as `system`, tool-call arguments as objects
    (templates such as Llama 3's write them with `tojson`; vLLM passes objects too)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatFormatError(f"messages[{i}] must be an object with a string 'role'")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if m["role"] == "developer" else m["role"]
        msg["content"] = content_text(m.get("content"), where=f"messages[{i}].content")
        if m.get("tool_calls"):
            msg["tool_calls"] = [_canonical_call(c, i, j) for j, c in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def _canonical_call(call: Any, i: int, j: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.name must be a string")
    fn = {**fn, "arguments": _arguments(fn.get("arguments", {}))}
    return {**call, "function": fn}


def _added_token_ids(folder: Path) -> dict[str, int]:
    """Added (special) tokens by text: tokenizer_config.json's `added_tokens_decoder`, else the (larger)
    tokenizer.json's `added_tokens`."""
    decoder = read_tokenizer_config(folder).get("added_tokens_decoder")
    if isinstance(decoder, dict) and decoder:
        return {t["content"]: int(i) for i, t in decoder.items() if isinstance(t, dict) and "content" in t}
    path = folder / "tokenizer.json"
    if not path.is_file():
        return {}
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    return {t["content"]: int(t["id"]) for t in added if isinstance(t, dict) and "content" in t}


def config_eos_ids(folder: Path) -> set[int]:
    """Every `eos_token_id` of a model folder's config.json and generation_config.json (an id or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def stop_markers(template: JinjaTemplate | None, vocab: dict[str, int]) -> tuple[str, ...]:
    """The end-of-turn markers of a template's family (those it writes, the eos token, `<|eom_id|>`)."""
    if template is None:
        return ("<|im_end|>",)
    eos = template.special_tokens.get("eos_token")
    found = [m for m in END_OF_TURN if m in template.source or m == eos]
    if "<|eot_id|>" in found and "<|eom_id|>" in vocab and "<|eom_id|>" not in found:
        found.append("<|eom_id|>")  # Llama 3.1+: the end of a turn that called a tool
    if eos and eos not in found:
        found.append(eos)
    return tuple(found)


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat format: prompt rendering, completion parsing, streaming parser and stop tokens."""

    renderer: str = "chatml"
    template: JinjaTemplate | None = None
    rules: CompletionRules = field(default_factory=lambda: CompletionRules(stop_texts=("<|im_end|>",)))
    stop_ids: frozenset[int] = frozenset()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    chatml: ChatTemplate = SMOLLM2

    @property
    def tool_parser(self) -> str:
        """The name of the tool-call format completions are parsed with."""
        return self.rules.tools.name

    @classmethod
    def from_folder(
        cls, folder: str | Path, tool_parser_name: str = "auto", template_kwargs: dict[str, Any] | None = None
    ) -> ChatFormat:
        """The chat format of a model folder (its own template; `tool_parser_name` overrides detection)."""
        folder = Path(folder)
        template = load_template(folder)
        vocab = _added_token_ids(folder)
        if template is None:  # the family's own turn markers, or a refusal (neutral.py)
            convention, source = neutral_convention(folder, vocab)
            log.warning("event=no_chat_template dir=%s using=%s", folder, convention)
            if source is not None:
                template = JinjaTemplate(source, neutral_special_tokens(folder))
        if template is not None:
            template.compiled  # noqa: B018 (a template that does not compile is refused here, not at a call)
        name = detect_tool_parser(template.source if template else None)
        stops = stop_markers(template, vocab)
        think = detect_think(template.source if template else None)
        fmt = cls(
            renderer=detect_renderer(template),
            template=template,
            rules=CompletionRules(
                tool_parser(name if tool_parser_name == "auto" else tool_parser_name), stops, think
            ),
            stop_ids=frozenset({vocab[s] for s in stops if s in vocab} | config_eos_ids(folder)),
            template_kwargs=dict(template_kwargs or {}),
            chatml=_chatml_for(template, folder),
        )
        if think is not None and fmt._prompt_opens_thinking():
            fmt = replace(fmt, rules=CompletionRules(fmt.rules.tools, stops, think, True))
        log.info("event=chat_format dir=%s renderer=%s tool_parser=%s stops=%s", folder, fmt.renderer,
                 fmt.tool_parser, list(stops))  # fmt: skip
        return fmt

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages (and tools) into the prompt text the model sees; `kwargs` (e.g.
        `enable_thinking`) override the run's template kwargs for this request."""
        if self.renderer == "chatml" or self.template is None:
            return render_chat(messages, tools, add_generation_prompt, self.chatml)
        if self.renderer == "folded" and (tools or _tool_turns(messages)):
            messages, tools = fold_tools(canonical_messages(messages), tools), None
        msgs = server_messages(messages, self.template.source)  # as vLLM's server hands them over
        return self.template.render(
            msgs, server_tools(tools), add_generation_prompt, **{**self.template_kwargs, **kwargs}
        )

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Split a completion's text into reasoning, content and tool calls (`tools`: the request's
        tools; formats that write arguments as text type them by their schemas)."""
        return self.rules.parse(text, tools)

    def streaming_parser(self, tools: list[dict[str, Any]] | None = None) -> CompletionStream:
        """A parser for one completion being generated (`feed`, `feed_parts`, `finish`)."""
        return CompletionStream(self.rules, tools)

    def for_request(self, template_kwargs: dict[str, Any] | None) -> ChatFormat:
        """This format for a request whose template kwargs override the run's: whether the generation
        prompt opens the thinking block (Qwen3.5's `enable_thinking`) is decided again for them."""
        if self.rules.think is None or not template_kwargs:
            return self
        opens = self._prompt_opens_thinking(template_kwargs)
        if opens == self.rules.think_started:
            return self
        return replace(self, rules=replace(self.rules, think_started=opens))

    def _prompt_opens_thinking(self, template_kwargs: dict[str, Any] | None = None) -> bool:
        try:
            prompt = self.render([{"role": "user", "content": "x"}], None, True, **(template_kwargs or {}))
        except ChatFormatError:
            return False
        think = self.rules.think
        return think is not None and prompt.rstrip().endswith(think.open)


def _tool_turns(messages: Any) -> bool:
    """Whether a conversation calls tools or answers a call (rendered with the convention when folded)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages
    )


def _chatml_for(template: JinjaTemplate | None, folder: Path | None = None) -> ChatTemplate:
    """SmolLM2's ChatML convention, with its default system prompt only where the template has it (a
    folder without a template gets none)."""
    if template is None and folder is None:
        return SMOLLM2
    if (
        template is not None
        and SMOLLM2.default_system is not None
        and SMOLLM2.default_system in template.source
    ):
        return SMOLLM2
    return ChatTemplate(default_system=None)


CHATML = ChatFormat()
