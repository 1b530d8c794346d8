"""A fast stub engine for gateway benchmarks: a raw asyncio HTTP/1.1 server (uvloop when installed)
that answers every POST with one precomputed vLLM-style body (~5 KB): top-level `prompt_token_ids`,
`choices[0].token_ids`, `choices[0].logprobs.content`, as vLLM's chat endpoint does with
`return_token_ids`. `python bench/stub_upstream.py PORT`."""

from __future__ import annotations

import asyncio
import json
import sys


def vllm_like_body(prompt_tokens: int = 300, completion_tokens: int = 40) -> bytes:
    """A chat.completion answer with token IDs and logprobs, about 5 KB."""
    content = [{"token": f"t{i}", "logprob": -0.123456, "bytes": [116, 48 + i % 10], "top_logprobs": []}
               for i in range(completion_tokens)]  # fmt: skip
    body = {
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
        "prompt_token_ids": list(range(1000, 1000 + prompt_tokens)),
        "choices": [{
            "index": 0, "finish_reason": "stop", "stop_reason": None,
            "message": {"role": "assistant", "content": " ".join(f"t{i}" for i in range(completion_tokens))},
            "logprobs": {"content": content},
            "token_ids": list(range(2000, 2000 + completion_tokens)),
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip
    return json.dumps(body).encode()


BODY = vllm_like_body()
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)
HEALTH = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


class StubProtocol(asyncio.Protocol):
    """Parses pipelined requests just enough (headers + Content-Length) and answers each at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(
                    head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None].strip()
                )
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(HEALTH if head.startswith(b"get /health") else RESPONSE)


def main() -> None:
    """Serve on 127.0.0.1:PORT until killed."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    port = int(sys.argv[1])
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(StubProtocol, "127.0.0.1", port, backlog=1024))
    try:
        loop.run_forever()
    finally:
        server.close()


if __name__ == "__main__":
    main()
