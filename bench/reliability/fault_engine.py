"""An engine that misbehaves on request, for the gateway's fault tests and `make bench-reliability`.

A raw asyncio HTTP/1.1 server (keep-alive, Content-Length requests, as the gateway's client sends them)
speaking the engine protocol's wire: `/v1/chat/completions` and `/v1/completions`, streamed or not (and `/tokenize`), with
`prompt_token_ids`, per-choice `token_ids` and logprobs (vLLM's shape). Nothing else can produce these
faults on demand, which is why a real engine is not used here.

A request picks its fault with the marker `fault:NAME` anywhere in its body (for example in a message);
`default_fault` applies when there is none:
- `ok`: a normal answer of `TOKENS` tokens;
- `500`: status 500 with an error body;
- `hang`: reads the request and never answers (not even the headers);
- `nonjson`: status 200 with a body (or stream event) that is not JSON;
- `close`: the answer starts, then the connection is closed in the middle of it;
- `badevent`: a logprobs entry without `logprob` (in the stream, the third event);
- `slow`: a streamed answer of `SLOW_TOKENS` tokens, one every `SLOW_INTERVAL_S`.

`python bench/reliability/fault_engine.py PORT [DEFAULT_FAULT] [--tokens N] [--prompt-tokens N]` serves
on 127.0.0.1 until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import threading
from typing import Any

TOKENS = 8
SLOW_TOKENS = 200
SLOW_INTERVAL_S = 0.05
PROMPT_IDS = list(range(1000, 1012))
MAX_MODEL_LEN = 8192
FAULT = re.compile(rb"fault:([a-z0-9]+)")


def _head(status: int, content_type: str, length: int | None = None) -> bytes:
    reason = {200: b"OK", 500: b"Internal Server Error"}.get(status, b"Error")
    lines = [b"HTTP/1.1 %d %s" % (status, reason), b"Content-Type: " + content_type.encode()]
    lines.append(b"Content-Length: %d" % length if length is not None else b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(event: dict[str, Any] | str) -> bytes:
    payload = event if isinstance(event, str) else json.dumps(event)
    return _chunk(f"data: {payload}\n\n".encode())


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt  # a token-ID prompt is echoed, as a real engine reports what it consumed
    return PROMPT_IDS


def answer(path: str, body: dict[str, Any], n: int | None = None, bad: bool = False) -> dict[str, Any]:
    """A complete non-streamed answer of `n` tokens (default `TOKENS`; `bad`: one logprobs entry lacks
    its logprob)."""
    n = TOKENS if n is None else n
    ids = [2000 + i for i in range(n)]
    texts = [f"t{i} " for i in range(n)]
    prompt = _prompt_ids(body)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    if path.endswith("/chat/completions"):
        content = [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in texts]
        if bad:
            del content[-1]["logprob"]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                                  "logprobs": {"content": content}, "token_ids": ids, "finish_reason": "stop"}  # fmt: skip
        return {"id": "chatcmpl-fault", "object": "chat.completion", "created": 0, "model": "fault",
                "prompt_token_ids": prompt, "choices": [choice], "usage": usage}  # fmt: skip
    lps: list[Any] = [-0.5] * n
    if bad:
        lps[-1] = None
    choice = {"index": 0, "text": "".join(texts), "token_ids": ids, "prompt_token_ids": prompt,
              "logprobs": {"tokens": texts, "token_logprobs": lps}, "finish_reason": "stop"}  # fmt: skip
    return {"id": "cmpl-fault", "object": "text_completion", "created": 0, "model": "fault",
            "prompt_token_ids": prompt, "choices": [choice], "usage": usage}  # fmt: skip


def stream_events(path: str, body: dict[str, Any], n: int, bad_at: int = -1) -> list[dict[str, Any]]:
    """The chunks of a streamed answer of `n` tokens (`bad_at`: that chunk's logprobs entry is broken)."""
    chat = path.endswith("/chat/completions")
    prompt = _prompt_ids(body)
    events: list[dict[str, Any]] = []
    for i in range(n):
        text = f"t{i} "
        if chat:
            entry: dict[str, Any] = {"token": text, "logprob": -0.5, "top_logprobs": []}
            if i == bad_at:
                del entry["logprob"]
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "token_ids": [2000 + i],
                                      "logprobs": {"content": [entry]}, "finish_reason": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "token_ids": [2000 + i], "finish_reason": None,
                      "logprobs": {"tokens": [text], "token_logprobs": [None if i == bad_at else -0.5]}}  # fmt: skip
        event: dict[str, Any] = {
            "id": "fault",
            "object": "chunk",
            "created": 0,
            "model": "fault",
            "choices": [choice],
        }
        if i == 0:
            event["prompt_token_ids"] = prompt
        events.append(event)
    last = {"index": 0, "token_ids": [], "finish_reason": "stop", "logprobs": None}
    last.update({"delta": {}} if chat else {"text": ""})
    usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
    events.append(
        {"id": "fault", "object": "chunk", "created": 0, "model": "fault", "choices": [last], "usage": usage}
    )
    return events


class FaultEngine(asyncio.Protocol):
    """One connection: requests in order, each answered according to its fault."""

    def __init__(self, default_fault: str = "ok") -> None:
        self.default_fault = default_fault
        self.buf = b""
        self.busy: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy is not None:
            self.busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.busy is None or self.busy.done():
            self.busy = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            match = re.search(r"(?im)^content-length:\s*(\d+)", head)
            length = int(match.group(1)) if match else 0
            if len(self.buf) < end + 4 + length:
                return
            raw, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            path = head.split(" ", 2)[1]
            await self._answer(path, raw)

    async def _answer(self, path: str, raw: bytes) -> None:
        assert self.transport is not None
        t = self.transport
        if path.startswith("/health"):
            t.write(_head(200, "application/json", 11) + b'{"ok":true}')
            return
        found = FAULT.search(raw)
        fault = found.group(1).decode() if found else self.default_fault
        body = json.loads(raw) if raw else {}
        stream = bool(body.get("stream"))
        if fault == "hang":
            await asyncio.Event().wait()
        if path.startswith("/tokenize"):
            data = json.dumps({"count": len(PROMPT_IDS), "max_model_len": MAX_MODEL_LEN}).encode()
            t.write(_head(200, "application/json", len(data)) + data)
            return
        if fault == "500":
            err = b'{"error":{"message":"engine fault injected"}}'
            t.write(_head(500, "application/json", len(err)) + err)
            return
        if not stream:
            await self._answer_whole(t, path, body, fault)
            return
        t.write(_head(200, "text/event-stream"))
        n = SLOW_TOKENS if fault == "slow" else TOKENS
        events = stream_events(path, body, n, bad_at=2 if fault == "badevent" else -1)
        for i, event in enumerate(events):
            if fault == "close" and i == 2:
                t.abort()
                return
            t.write(_sse("not json {" if fault == "nonjson" and i == 1 else event))
            if fault == "slow":
                await asyncio.sleep(SLOW_INTERVAL_S)
        t.write(_sse("[DONE]") + b"0\r\n\r\n")

    @staticmethod
    async def _answer_whole(t: asyncio.Transport, path: str, body: dict[str, Any], fault: str) -> None:
        if fault == "nonjson":
            page = b"<html>the engine is not itself</html>"
            t.write(_head(200, "text/html", len(page)) + page)
            return
        data = json.dumps(answer(path, body, bad=fault == "badevent")).encode()
        if fault == "close":
            t.write(_head(200, "application/json", len(data)) + data[: len(data) // 2])
            t.abort()
            return
        t.write(_head(200, "application/json", len(data)) + data)


async def serve(port: int, default_fault: str = "ok") -> asyncio.Server:
    """Start a fault engine on 127.0.0.1:`port`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: FaultEngine(default_fault), "127.0.0.1", port, backlog=1024)


def main() -> None:
    """Serve until killed."""
    global TOKENS, PROMPT_IDS, SLOW_TOKENS, SLOW_INTERVAL_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("port", type=int)
    p.add_argument("default_fault", nargs="?", default="ok")
    p.add_argument("--tokens", type=int, default=TOKENS, help="completion tokens of an answer")
    p.add_argument("--prompt-tokens", type=int, default=len(PROMPT_IDS), help="prompt tokens reported")
    p.add_argument("--slow-tokens", type=int, default=SLOW_TOKENS, help="tokens of a `slow` answer")
    p.add_argument("--slow-interval", type=float, default=SLOW_INTERVAL_S, help="seconds between its tokens")
    args = p.parse_args()
    TOKENS, PROMPT_IDS = args.tokens, list(range(1000, 1000 + args.prompt_tokens))
    SLOW_TOKENS, SLOW_INTERVAL_S = args.slow_tokens, args.slow_interval
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one socket per open stream
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    loop = asyncio.new_event_loop()
    loop.run_until_complete(serve(args.port, args.default_fault))
    loop.run_forever()


if __name__ == "__main__":
    main()


class FaultEngineThread:
    """A fault engine on a free loopback port, served by a thread of its own (for tests)."""

    def __init__(self, port: int, default_fault: str = "ok") -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.default_fault = default_fault
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault-engine-{port}", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(serve(self.port, self.default_fault))
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> FaultEngineThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the fault engine did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
