"""The prompt a model sees here is the prompt vLLM's OpenAI server renders for the same request.

tests/fixtures/vllm_renders.json was recorded once with vLLM 0.32's own request validation, content
parsing and template application (bench/record_vllm_renders.py, vLLM's venv from `make install-vllm`) for
every conversation of tests/support/render_corpus.py and the five families' real templates; the chat
format renders the same requests and must give the same text, or refuse where vLLM refused. The
`vllm`-marked test re-renders live through vLLM when its venv is there."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from harnessrl.chat import ChatFormat, ChatFormatError
from harnessrl.chat.serving import content_format, server_messages, server_tools
from tests.support.conversations import FAMILIES, tokenizer_dir
from tests.support.render_corpus import CASES, DATE

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "vllm_renders.json"
VLLM_PY = ROOT / ".bench" / "venv-vllm" / "bin" / "python"


@cache
def chat_format(family: str) -> ChatFormat:
    return ChatFormat.from_folder(tokenizer_dir(family))


def ours(family: str, case: dict[str, Any]) -> dict[str, str]:
    try:
        return {"prompt": chat_format(family).render(case["messages"], case["tools"], True, **DATE)}
    except ChatFormatError as e:
        return {"error": str(e)}


def _check(family: str, case: dict[str, Any], reference: dict[str, str]) -> None:
    got = ours(family, case)
    if "error" in reference:
        assert "error" in got, f"vLLM refused ({reference['error']}) but harnessrl rendered"
    else:
        assert got.get("prompt") == reference["prompt"]


@pytest.mark.parametrize("family", FAMILIES)
def test_renders_as_vllm_renders(family: str) -> None:
    recorded = json.loads(FIXTURE.read_text(encoding="utf-8"))["renders"]
    for case in CASES:
        _check(family, case, recorded[f"{family}/{case['name']}"])


def test_vllm_preprocessing_facts() -> None:
    """The rules the differential relies on, on their own (see harnessrl.chat.serving)."""
    assert content_format(chat_format("gemma3").template.source) == "openai"  # type: ignore[union-attr]
    assert content_format(chat_format("qwen3").template.source) == "string"  # type: ignore[union-attr]
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b"]}
    assert server_messages([parts], "{{ messages }}")[0]["content"] == "a\nb"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
    assert (
        server_messages([{"role": "assistant", "content": None, "tool_calls": [call]}], "")[0]["tool_calls"][
            0
        ]["function"]["arguments"]
        == {}
    )
    assert server_tools([{"type": "function", "function": {"name": "f"}}]) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]
    with pytest.raises(ChatFormatError, match=r"messages\[0\].content\[0\]"):
        server_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "")


@pytest.mark.vllm
def test_live_vllm_renders_the_fixture(tmp_path: Path) -> None:
    """Re-render the corpus through vLLM itself (its venv) and compare with the chat format."""
    if not VLLM_PY.is_file():
        pytest.skip("no vLLM venv here: make install-vllm")
    out = tmp_path / "renders.json"
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HARNESSRL_RENDERS_OUT": str(out)}
    subprocess.run([str(VLLM_PY), "bench/record_vllm_renders.py"], cwd=ROOT, check=True, timeout=600, env=env)
    live = json.loads(out.read_text(encoding="utf-8"))["renders"]
    for family in FAMILIES:
        for case in CASES:
            _check(family, case, live[f"{family}/{case['name']}"])


def test_gateway_tool_map_renders_as_vllm() -> None:
    """The gateway's chat face keeps a tool's missing description and parameters as vLLM does (null)."""
    from harnessrl.gateway.faces.tools import chat_tools

    recorded = json.loads(FIXTURE.read_text(encoding="utf-8"))["renders"]
    case = next(c for c in CASES if c["name"] == "tools_without_description")
    tools = chat_tools(case["tools"]).functions
    for family in ("qwen3", "llama3_2"):
        prompt = chat_format(family).render(case["messages"], tools, True, **DATE)
        assert prompt == recorded[f"{family}/{case['name']}"]["prompt"] and '"description": null' in prompt
