"""Record what vLLM's OpenAI server renders for the render corpus: tests/fixtures/vllm_renders.json.

Run ONCE with vLLM's own venv (`make install-vllm`), from the repository root:

    .bench/venv-vllm/bin/python bench/record_vllm_renders.py

For each family's real tokenizer and template (.cache/tokenizers) and each conversation of
tests/support/render_corpus.py, the request goes through vLLM's own code, as its chat endpoint runs it:
`ChatCompletionRequest` validation, the tools' `model_dump`, the template's content format
(`_detect_content_format`), `parse_chat_messages` and `safe_apply_chat_template(tokenize=False)` (the text
the server tokenizes). No server is started: these functions are the whole text path; the model config
they read is a stand-in for a text-only model. Templates without tool support (Llama 3.0, Gemma 3) get a
tool conversation as harnessrl's convention writes it (`harnessrl.chat.convention.fold_tools`), which is
what such a model sees from harnessrl. A request vLLM refuses is recorded as its error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import transformers  # noqa: E402
import vllm  # noqa: E402
from tests.support.render_corpus import CASES, DATE, has_tools  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.renderers.chat_utils import parse_chat_messages  # noqa: E402
from vllm.renderers.hf import _detect_content_format, safe_apply_chat_template  # noqa: E402

from harnessrl.chat.convention import fold_tools  # noqa: E402

FAMILIES = ("qwen3", "qwen2_5", "llama3", "llama3_2", "gemma3")
FOLDED = ("llama3", "gemma3")  # templates that do not read `tools`
OUT = Path(os.environ.get("HARNESSRL_RENDERS_OUT") or ROOT / "tests" / "fixtures" / "vllm_renders.json")
# what parse_chat_messages reads of the model config for text-only content
MODEL_CONFIG = SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False, is_multimodal_model=False)


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], tools: Any) -> str:
    """vLLM's prompt text for one chat request."""
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools:
        body["tools"] = tools
    request = ChatCompletionRequest.model_validate(body)
    tool_dicts = None if request.tools is None else [t.model_dump() for t in request.tools]
    fmt = _detect_content_format(template, default="string")
    conversation, _, _ = parse_chat_messages(request.messages, MODEL_CONFIG, fmt)  # type: ignore[arg-type]
    return safe_apply_chat_template(MODEL_CONFIG, tokenizer, conversation, tools=tool_dicts,  # type: ignore[arg-type]
                                    chat_template=template, tokenize=False, add_generation_prompt=True, **DATE)  # fmt: skip


def main() -> None:
    """Render every case for every family and write the fixture."""
    out: dict[str, Any] = {"vllm": vllm.__version__, "transformers": transformers.__version__, "renders": {}}
    for family in FAMILIES:
        folder = ROOT / ".cache" / "tokenizers" / family
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        template = tokenizer.get_chat_template()
        for case in CASES:
            messages, tools = case["messages"], case["tools"]
            if family in FOLDED and has_tools(case):
                messages, tools = fold_tools(messages, tools), None
            try:
                text: dict[str, str] = {"prompt": render(tokenizer, template, messages, tools)}
            except Exception as e:
                text = {"error": f"{type(e).__name__}: {e}"}
            out["renders"][f"{family}/{case['name']}"] = text
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(out['renders'])} renders, vllm {vllm.__version__})")


if __name__ == "__main__":
    main()
