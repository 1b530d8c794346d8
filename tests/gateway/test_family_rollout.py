"""A rollout through the real gateway and the builtin engine for a model whose folder carries Qwen3's
real tokenizer and template: the OpenAI SDK with tools and `chat_template_kwargs`, three calls, tito.

Checks the prompt is the model's own template (token for token transformers'), the per-request
`enable_thinking: false` reaches the template in tito and in passthrough, and the three calls merge
into one row without breaks."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from harnessrl.adapter import merge_calls
from harnessrl.engine.core import Engine
from harnessrl.engine.server import EngineConfig, ServerThread
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.schema import CallStatus
from harnessrl.store import SQLiteStore
from tests.support.conversations import TOOLS, tokenizer_dir
from tests.support.gateway import GatewayHandle, ThreadServer
from tests.support.tiny_families import tiny_family_dir

transformers = pytest.importorskip("transformers")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerThread]]:
    """The builtin engine on a tiny model with Qwen3's tokenizer and template."""
    folder = tiny_family_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")
    srv = ServerThread(Engine(EngineConfig(model=str(folder), max_batch=2, max_model_len=4096, threads=1)))
    yield folder, srv.start()
    srv.stop()


def gateway(tmp_path: Path, engine: ServerThread, **overrides: Any) -> tuple[GatewayHandle, ThreadServer]:
    """A gateway in this process over a fresh SQLite store, upstream = the engine."""
    admin_key = "admin-" + secrets.token_hex(8)
    store = SQLiteStore(tmp_path / f"store-{secrets.token_hex(3)}.sqlite")
    cfg = GatewayConfig.model_validate({"admin_key": admin_key, "upstream_url": engine.url, **overrides})
    srv = ThreadServer(create_app(cfg, store)).__enter__()
    return GatewayHandle(srv.url, admin_key, store, engine.url), srv


def conversation(gw: GatewayHandle, key: str) -> list[dict[str, Any]]:
    """Three calls: a question, a tool result, a user follow-up (answers appended as the SDK returns them)."""
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use tools."},
                                      {"role": "user", "content": "What is 2+3?"}]  # fmt: skip
    follow_ups = [
        {"role": "tool", "tool_call_id": "call_x", "content": "5"},
        {"role": "user", "content": "Thanks!"},
    ]
    for i in range(3):
        resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8,  # type: ignore[arg-type]
                                              extra_body=NO_THINKING)  # fmt: skip
        messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        messages += follow_ups[i : i + 1]
    return messages


def test_qwen3_rollout_in_tito_merges_into_one_row(
    qwen3_engine: tuple[Path, ServerThread], tmp_path: Path
) -> None:
    folder, engine = qwen3_engine
    gw, srv = gateway(tmp_path, engine, mode="tito", tokenizer_path=str(folder))
    try:
        rid, key = gw.new_rollout(sampling={"temperature": 1.0})
        first = conversation(gw, key)[:2]
        calls = gw.store.calls(rid)
        assert len(calls) == 3 and all(c.status == CallStatus.OK for c in calls)
        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen3")))
        expected = tok.apply_chat_template(first, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                           return_dict=False, enable_thinking=False)  # fmt: skip
        assert calls[0].prompt_ids == list(expected)
        assert tok.decode(calls[0].prompt_ids[-6:]).endswith("<think>\n\n</think>\n\n")
        result = merge_calls(calls)
        assert len(result.rows) == 1 and result.breaks == []
        assert sum(result.rows[0].loss_mask) == sum(len(c.completion_ids) for c in calls)
        # passthrough: the engine renders the same prompt from the same per-request kwargs
        pt, pt_srv = gateway(tmp_path, engine)
        try:
            rid2, key2 = pt.new_rollout()
            client = OpenAI(base_url=f"{pt.url}/v1", api_key=key2, max_retries=0)
            client.chat.completions.create(
                model="m", messages=first, tools=TOOLS, max_tokens=2, extra_body=NO_THINKING
            )  # type: ignore[arg-type]
            stream = client.chat.completions.create(model="m", messages=first, tools=TOOLS, max_tokens=2,  # type: ignore[arg-type]
                                                    extra_body=NO_THINKING, stream=True)  # fmt: skip
            assert [c.choices[0].finish_reason for c in stream if c.choices][-1] is not None
            assert [c.prompt_ids for c in pt.store.calls(rid2)] == [calls[0].prompt_ids] * 2
        finally:
            pt_srv.__exit__()
    finally:
        srv.__exit__()
