"""The engine on a tiny Qwen3.5 (transformers path) carrying Qwen3.5's real chat template: the prompt of a
tool conversation is the token IDs transformers' `apply_chat_template` gives, and a streamed chat answer
with tools is the unstreamed one (same tokens; content, reasoning and tool calls parsed alike)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl.engine.core import Engine
from harnessrl.engine.server import EngineConfig, ServerThread
from tests.support.conversations import TOOL_CONVERSATION, TOOLS
from tests.support.generic_families import generic_dir
from tests.support.templates import template_source

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    folder = tmp_path_factory.mktemp("qwen35-template") / "model"
    shutil.copytree(generic_dir("qwen3_5"), folder)
    (folder / "chat_template.jinja").write_text(template_source("qwen3_5"), encoding="utf-8")
    srv = ServerThread(Engine(EngineConfig(model=str(folder), max_batch=2, max_model_len=1024, threads=1)))
    yield srv.start(), folder
    srv.stop()


def test_prompt_ids_as_transformers_and_streamed_equals_unstreamed(served: tuple[ServerThread, Path]) -> None:
    srv, folder = served
    messages = TOOL_CONVERSATION[:2]
    ours = httpx.post(srv.url + "/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=60).json()
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours["tokens"] == list(theirs)
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 12, "temperature": 0.0}
    whole = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    frames: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [f["choices"][0]["delta"] for f in frames]
    assert [t for f in frames for t in f["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(d.get("content") or "" for d in deltas) == (whole["message"]["content"] or "")
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == (whole["message"].get("reasoning_content") or "")
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"] for c in streamed_calls] == [
        c["function"] for c in whole["message"].get("tool_calls") or []
    ]


def test_a_request_that_turns_thinking_on_gets_its_text_as_reasoning(
    served: tuple[ServerThread, Path],
) -> None:
    # This Qwen3.5 template closes the thinking block in the prompt unless `enable_thinking` is true; a
    # request that sets it gets `<think>` opened, so what the model writes before `</think>` is reasoning,
    # streamed or not (the parser follows the request's kwargs, not the engine's).
    srv, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    prompt = httpx.post(srv.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    closed = httpx.post(srv.url + "/tokenize", json={**body, "chat_template_kwargs": {}}, timeout=60).json()
    assert prompt != closed["tokens"]  # the kwarg did change the prompt
    whole = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    reasoning = whole["message"].get("reasoning_content")
    assert reasoning and "</think>" not in reasoning and not (whole["message"]["content"] or "").strip()
    with httpx.stream(
        "POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in r.iter_lines() if x.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert not "".join(d.get("content") or "" for d in deltas).strip()
