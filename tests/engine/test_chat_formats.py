"""The builtin engine speaks each family's chat format: prompts from the folder's own template (token for
token what transformers' `apply_chat_template` gives), the family's stop ids, tool calls and reasoning
parsed in the family's format, whole and streamed, over loopback HTTP.

The models are tiny random Llamas (hidden 16, one layer) carrying the real Llama 3.2 and Qwen3 tokenizers
and templates: the chat format depends on the folder's tokenizer files only, and the engine serves the
Llama architecture today (the Qwen3 architecture comes with the families work, tests/support/families.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harnessrl.engine.core import Engine
from harnessrl.engine.protocol import EngineChatCompletionRequest, chat_response
from harnessrl.engine.scheduler import GenerationResult
from harnessrl.engine.server import EngineConfig, ServerThread
from tests.support.conversations import TOOL_CONVERSATION, TOOLS, tokenizer_dir
from tests.support.tiny_families import FAMILY_IDS, tiny_family_dir

transformers = pytest.importorskip("transformers")
FAMILIES = FAMILY_IDS


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """An engine server on the family's tiny model."""
    folder = tiny_family_dir(tmp_path_factory.mktemp("family"), request.param)
    srv = ServerThread(
        Engine(EngineConfig(model=str(folder), max_batch=2, max_model_len=4096, threads=1))
    ).start()
    srv.family = request.param  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def post(server: ServerThread, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST over loopback; the JSON answer (asserting 200)."""
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, dict)
    return out


def test_prompt_ids_equal_transformers(server: ServerThread) -> None:
    family = server.family  # type: ignore[attr-defined]
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir(family)))
    kw = {"date_string": "26 Jul 2024"}
    expected = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                       return_dict=False, **kw)  # fmt: skip
    body = {"messages": TOOL_CONVERSATION, "tools": TOOLS, "chat_template_kwargs": kw}
    assert post(server, "/tokenize", body)["tokens"] == list(expected)
    answer = post(server, "/v1/chat/completions", {**body, "max_tokens": 3, "temperature": 0})
    assert answer["prompt_token_ids"] == list(expected)


def test_family_stop_ids(server: ServerThread) -> None:
    family = server.family  # type: ignore[attr-defined]
    engine = server.engine
    want = {"llama3_2": {128008, 128009}, "qwen3": {151645}}[family]
    assert want <= engine.eos_ids


def test_streamed_chat_reports_the_same_tokens(server: ServerThread) -> None:
    body = {
        "messages": TOOL_CONVERSATION[:2],
        "tools": TOOLS,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    ids: list[int] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    whole = post(server, "/v1/chat/completions", {**body, "stream": False})
    assert ids == whole["choices"][0]["token_ids"] and len(ids) >= 1


def _result(text: str) -> GenerationResult:
    return GenerationResult([1, 2], [5, 6], [-0.1, -0.2], [[], []], text, "stop", None, 0, 0)


def test_chat_response_in_each_family_format(server: ServerThread) -> None:
    family = server.family  # type: ignore[attr-defined]
    chat = server.engine.chat
    text = {
        "llama3_2": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        "qwen3": '<think>\nAdd.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    }[family]
    req = EngineChatCompletionRequest(messages=TOOL_CONVERSATION[:2])
    choice = chat_response(_result(text), "m", None, req, chat)["choices"][0]  # type: ignore[arg-type]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert choice["message"].get("reasoning_content") == ("Add." if family == "qwen3" else None)


def test_engine_flags_and_their_errors() -> None:
    from harnessrl.engine.server import parse_args

    cfg = parse_args(["--tool-parser", "llama3_json", "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert cfg.tool_parser == "llama3_json" and cfg.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="tool_parser must be auto or one of"):
        EngineConfig(tool_parser="xml")
