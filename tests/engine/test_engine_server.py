"""The builtin engine over real HTTP on loopback: protocol shapes, exact logprobs, batching, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harnessrl.engine.protocol import EngineChatCompletionRequest, chat_response
from harnessrl.engine.sequence import GenerationResult
from harnessrl.engine.server import ServerThread
from harnessrl.modeling.llama import LlamaForCausalLM
from tests.support.engine_server import (
    TINY_MAX_LEN,
    full_forward_logprobs,
)

MESSAGES = [{"role": "user", "content": "What is 6 times 7?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]


def post(server: ServerThread, path: str, body: Any) -> httpx.Response:
    """POST JSON (or raw bytes) to the engine."""
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url + path, timeout=60, **kwargs)


async def post_together(
    server: ServerThread, path: str, bodies: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Send requests while admission is paused, then resume: they all join one batch."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        await client.post("/admin/pause")
        tasks = [asyncio.create_task(client.post(path, json=b)) for b in bodies]
        while (await client.get("/admin/stats")).json()["waiting"] < len(bodies):
            await asyncio.sleep(0.01)
        await client.post("/admin/resume")
        responses = await asyncio.gather(*tasks)
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def test_completion_with_text_prompt(engine_server: ServerThread) -> None:
    r = post(engine_server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 5, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["weight_version"] == 0
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 5
    )
    assert (
        body["prompt_token_ids"]
        == post(engine_server, "/tokenize", {"prompt": "Hello there"}).json()["tokens"]
    )
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }


def test_token_id_prompt_and_return_token_ids(engine_server: ServerThread) -> None:
    prompt = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]
    body = post(
        engine_server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
    ).json()
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["prompt_token_ids"] == prompt
    assert len(body["choices"][0]["token_ids"]) == 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_full_forward_under_concurrent_batching(
    engine_server: ServerThread, engine_tiny_model: LlamaForCausalLM, temperature: float
) -> None:
    prompts = [[1, 4093, 198] + [100 + 37 * i + j for j in range(3 + 5 * i)] for i in range(5)]
    bodies = [
        {"prompt": p, "max_tokens": 12 + 3 * i, "temperature": temperature, "seed": i, "logprobs": 0}
        for i, p in enumerate(prompts)
    ]
    results = asyncio.run(post_together(engine_server, "/v1/completions", bodies))
    for prompt, res in zip(prompts, results, strict=True):
        ids = res["choices"][0]["token_ids"]
        reported = torch.tensor(_logprobs(res))
        recomputed = full_forward_logprobs(engine_tiny_model, prompt, ids, temperature)
        assert (reported - recomputed).abs().max().item() < 1e-4
    assert httpx.get(engine_server.url + "/admin/stats").json()["max_batch_seen"] >= len(prompts)


def _logprobs(res: dict[str, Any]) -> list[float]:
    choice = res["choices"][0]
    if choice.get("logprobs"):
        return list(choice["logprobs"]["token_logprobs"])
    raise AssertionError("no logprobs in response")


def test_chat_logprobs_include_eos_and_match_full_forward(
    engine_server: ServerThread, engine_tiny_model: LlamaForCausalLM
) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0.7,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    res = post(engine_server, "/v1/chat/completions", body).json()
    choice = res["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert all(len(c["top_logprobs"]) == 2 and bytes(c["bytes"]) for c in content)
    reported = torch.tensor([c["logprob"] for c in content])
    recomputed = full_forward_logprobs(engine_tiny_model, res["prompt_token_ids"], choice["token_ids"], 0.7)
    assert (reported - recomputed).abs().max().item() < 1e-4


def test_seed_determinism(engine_server: ServerThread) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    a, b = (post(engine_server, "/v1/completions", body).json() for _ in range(2))
    c = post(engine_server, "/v1/completions", {**body, "seed": 4321}).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]


def test_stop_string_truncates_text_and_keeps_tokens(engine_server: ServerThread) -> None:
    body = {"prompt": "List: one, two,", "max_tokens": 24, "temperature": 1.0, "seed": 5}
    full = post(engine_server, "/v1/completions", body).json()["choices"][0]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the sample should have text to stop on"
    cut = post(engine_server, "/v1/completions", {**body, "stop": [stop, "@@never@@"]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[: text.index(stop)]
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]
    assert len(cut["token_ids"]) < len(full["token_ids"])


def test_stop_token_id_is_kept_in_ids_not_in_text(engine_server: ServerThread) -> None:
    body = {"prompt": "Count: 1 2 3", "max_tokens": 8, "temperature": 0}
    first = post(engine_server, "/v1/completions", body).json()["choices"][0]
    target = first["token_ids"][2]
    res = post(engine_server, "/v1/completions", {**body, "stop_token_ids": [target]}).json()["choices"][0]
    assert res["finish_reason"] == "stop" and res["stop_reason"] == target
    assert res["token_ids"] == first["token_ids"][: first["token_ids"].index(target) + 1]


def test_max_tokens_gives_length(engine_server: ServerThread) -> None:
    res = post(
        engine_server, "/v1/completions", {"prompt": "a b c", "max_tokens": 3, "ignore_eos": True}
    ).json()
    assert res["choices"][0]["finish_reason"] == "length"
    assert res["usage"]["completion_tokens"] == 3


def test_chat_with_tools_shape_and_prompt_ids(engine_server: ServerThread) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    res = post(engine_server, "/v1/chat/completions", body).json()
    assert res["object"] == "chat.completion" and res["weight_version"] == 0
    choice = res["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    with_tools = post(engine_server, "/tokenize", {"messages": MESSAGES, "tools": TOOLS}).json()["tokens"]
    assert res["prompt_token_ids"] == with_tools
    none = post(engine_server, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()
    assert (
        none["prompt_token_ids"] == post(engine_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    )
    assert len(none["prompt_token_ids"]) < len(with_tools)


def test_chat_response_parses_tool_calls() -> None:
    text = 'Let me compute.<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    result = GenerationResult([1, 2], [5, 6, 2], [-0.1, -0.2, -0.3], [[], [], []], text, "stop", None, 3, 0)
    req = EngineChatCompletionRequest(messages=MESSAGES)
    body = chat_response(result, "m", None, req)  # type: ignore[arg-type]  # no logprobs asked: text unused
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "calc", "arguments": '{"expr": "6*7"}'}
    assert choice["message"]["content"] == "Let me compute."
    assert choice["token_ids"] == [5, 6, 2] and body["weight_version"] == 3


def test_models_health_tokenize_detokenize(engine_server: ServerThread) -> None:
    models = httpx.get(engine_server.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == TINY_MAX_LEN
    assert httpx.get(engine_server.url + "/health").json()["status"] == "ok"
    toks = post(engine_server, "/tokenize", {"prompt": "<|im_start|>user\nhi<|im_end|>"}).json()
    assert toks["tokens"][0] == 1 and toks["tokens"][-1] == 2 and toks["count"] == len(toks["tokens"])
    text = post(engine_server, "/detokenize", {"tokens": toks["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>"


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "n": 2}, "n"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [99999999], "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": TINY_MAX_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * TINY_MAX_LEN, "max_tokens": 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, "n"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": TINY_MAX_LEN},
        "max_completion_tokens",
    ),
    ("/tokenize", {}, "prompt"),
    ("/admin/load_weights", {"path": "/nonexistent", "version": 1}, "path"),
    ("/admin/load_weights", {"path": 3}, "path"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_input_is_a_400_in_openai_shape(
    engine_server: ServerThread, path: str, body: Any, param: str | None
) -> None:
    r = post(engine_server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    assert httpx.get(engine_server.url + "/health").status_code == 200


def test_prefix_cache_reuses_an_earlier_call(
    engine_server: ServerThread, engine_tiny_model: LlamaForCausalLM
) -> None:

    first = post(
        engine_server, "/v1/completions", {"prompt": list(range(300, 360)), "max_tokens": 8, "seed": 1}
    ).json()
    ids = first["choices"][0]["token_ids"]
    follow = [*list(range(300, 360)), *ids, 11, 12, 13]
    second = post(
        engine_server, "/v1/completions", {"prompt": follow, "max_tokens": 6, "seed": 2, "logprobs": 0}
    ).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 60
    reported = torch.tensor(_logprobs(second))
    recomputed = full_forward_logprobs(engine_tiny_model, follow, second["choices"][0]["token_ids"], 1.0)
    assert (reported - recomputed).abs().max().item() < 1e-4


def stream(server: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with `stream: true`; the parsed SSE data frames (checks the `[DONE]` terminator)."""
    frames: list[dict[str, Any]] = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    return frames


@pytest.mark.parametrize("cut", [False, True])
def test_streamed_completion_equals_the_unstreamed_one(engine_server: ServerThread, cut: bool) -> None:
    body: dict[str, Any] = {"prompt": "List: one, two,", "max_tokens": 24, "temperature": 1.0, "seed": 7,
                            "logprobs": 0}  # fmt: skip
    if cut:  # a stop string in the middle of the sample: streamed text must never run past it
        text = post(engine_server, "/v1/completions", body).json()["choices"][0]["text"]
        body["stop"] = [text[len(text) // 2 : len(text) // 2 + 2]]
    whole = post(engine_server, "/v1/completions", body).json()
    frames = stream(engine_server, "/v1/completions", body)
    assert frames[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert len(frames) == len(whole["choices"][0]["token_ids"]) + 1  # a frame per token, then the end
    streamed_ids = [t for f in frames for t in f["choices"][0]["token_ids"]]
    streamed_text = "".join(f["choices"][0]["text"] for f in frames)
    assert streamed_ids == whole["choices"][0]["token_ids"]
    assert streamed_text == whole["choices"][0]["text"]
    assert sum(1 for f in frames if f["choices"][0]["text"]) >= 2  # text arrives as it is sampled
    lps = [lp for f in frames[:-1] for lp in f["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
    last = frames[-1]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["usage"]["completion_tokens"] == len(streamed_ids) and last["weight_version"] == 0


def test_streamed_chat_equals_the_unstreamed_one(engine_server: ServerThread) -> None:
    body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 1.0, "seed": 11, "logprobs": True}
    whole = post(engine_server, "/v1/chat/completions", body).json()
    frames = stream(engine_server, "/v1/chat/completions", body)
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert frames[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    ids = [t for f in frames for t in f["choices"][0]["token_ids"]]
    content = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames)
    assert ids == whole["choices"][0]["token_ids"]
    assert content == (whole["choices"][0]["message"]["content"] or "")
    assert frames[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(
    engine_tiny_dir: Path, engine_tiny_model: LlamaForCausalLM
) -> None:
    from tests.support.engine_server import start_server

    server = start_server(engine_tiny_dir, "chunked", prefill_chunk=16, max_cached_tokens=TINY_MAX_LEN + 100)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            short = {"prompt": [1, 4093, 198, 30], "max_tokens": 40, "temperature": 1.0, "seed": 1,
                     "logprobs": 0, "ignore_eos": True}  # fmt: skip
            first = asyncio.create_task(client.post("/v1/completions", json=short))
            while (await client.get("/admin/stats")).json()["decode_steps"] < 2:
                await asyncio.sleep(0.005)
            long = {"prompt": [1] + [200 + i for i in range(90)], "max_tokens": 8, "temperature": 0.7,
                    "seed": 2, "logprobs": 0}  # fmt: skip
            second = await client.post("/v1/completions", json=long)
            return [(await first).json(), second.json()]

    before = httpx.get(server.url + "/admin/stats").json()
    results = asyncio.run(run())
    after = httpx.get(server.url + "/admin/stats").json()
    # 91 prompt tokens in chunks of 16 while the first sequence decodes: >= 6 prefill passes, each
    # followed by a decode step of the running sequence
    assert after["decode_steps"] - before["decode_steps"] >= 6 + 8
    for res, temp in zip(results, (1.0, 0.7), strict=True):
        ids = res["choices"][0]["token_ids"]
        got = torch.tensor(_logprobs(res))
        want = full_forward_logprobs(engine_tiny_model, res["prompt_token_ids"], ids, temp)
        assert (got - want).abs().max().item() < 1e-4


def test_kv_budget_holds_requests_until_running_ones_finish(engine_tiny_dir: Path) -> None:
    from tests.support.engine_server import start_server

    server = start_server(engine_tiny_dir, "budget", max_cached_tokens=TINY_MAX_LEN)
    body = {"prompt": [1, 4093, 198], "max_tokens": TINY_MAX_LEN - 10, "ignore_eos": True, "temperature": 1.0}
    results = asyncio.run(post_together(server, "/v1/completions", [body, body]))
    assert all(r["usage"]["completion_tokens"] == TINY_MAX_LEN - 10 for r in results)
    # each reservation is nearly the whole budget, so the two never ran side by side
    assert httpx.get(server.url + "/admin/stats").json()["max_batch_seen"] == 1
