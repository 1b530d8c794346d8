"""A fork-server preload for harnesses on the `openai` SDK: `controller.preload: [harnessrl.preload.openai]`.

Importing `openai` alone leaves most of a first request's work to each forked harness: the SDK imports
its resources, httpx its transports, and pydantic builds the validators of the request and response
types lazily, at the first call. Done in every child, that is ~15 MB of private memory per harness
(32 harnesses at once: ~0.5 GB). Importing this module instead makes one chat-completions call with
tools, one streamed call and one legacy completions call against an in-process transport, and one call
through the SDK's default client to a loopback socket that never answers (cut after 50 ms; no network,
no server), so those imports and validators are built once, in the fork server, and shared by every
child copy-on-write.
"""

from __future__ import annotations

import importlib
import json
import socket
from typing import Any

import openai

# The HTTP library the SDK's default client is built on (httpx2 in openai 3.x, httpx before): the one
# whose transports and connection pool the harness's own calls will use.
_http: Any = importlib.import_module("httpx2" if hasattr(openai, "DefaultHttpx2Client") else "httpx")

_CHAT = {
    "id": "chatcmpl-preload",
    "object": "chat.completion",
    "created": 0,
    "model": "preload",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "logprobs": None,
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
_CHUNK = {
    "id": "chatcmpl-preload",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "preload",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
}
_COMPLETION = {
    "id": "cmpl-preload",
    "object": "text_completion",
    "created": 0,
    "model": "preload",
    "choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _answer(request: Any) -> Any:
    body = json.loads(request.content)
    if request.url.path.endswith("/completions") and "messages" not in body:
        return _http.Response(200, json=_COMPLETION)
    if body.get("stream"):
        sse = f"data: {json.dumps(_CHUNK)}\n\ndata: [DONE]\n\n"
        return _http.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
    return _http.Response(200, json=_CHAT)


def warm() -> None:
    """Make the SDK's first calls once, in this process: in-process transport, then a silent loopback socket."""
    with _http.Client(transport=_http.MockTransport(_answer)) as http:
        client = openai.OpenAI(base_url="http://preload.invalid/v1", api_key="preload", http_client=http)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "x"}]
        client.chat.completions.create(model="preload", messages=messages, tools=tools, max_tokens=1)  # type: ignore[arg-type]
        for _ in client.chat.completions.create(model="preload", messages=messages, stream=True):  # type: ignore[arg-type]
            pass
        client.completions.create(model="preload", prompt="x", max_tokens=1)
    # The default client (its TLS context, its transport and connection pool: most of what a harness
    # imports at its first call) once over loopback, to a socket that listens but never answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with openai.OpenAI(base_url=url, api_key="preload", max_retries=0, timeout=0.05) as client:
            try:
                client.chat.completions.create(model="preload", messages=messages, max_tokens=1)  # type: ignore[arg-type]
            except openai.APIConnectionError:  # the timeout, as intended
                pass


warm()
