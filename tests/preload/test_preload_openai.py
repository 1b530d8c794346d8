"""`harnessrl.preload.openai` (a fork-server preload): importing it makes the SDK's first calls once, so a
harness forked after it builds little of its own. Measured the way the fork server uses it: a fresh
interpreter preloads, forks, and the child makes the calc harness's kind of call (chat completions with a
tool, the SDK's default client, over loopback HTTP to a real server); the child's private memory after
its calls is compared."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

SERVER = """
import http.server, json
CHAT = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [{"index": 0,
        "finish_reason": "tool_calls", "logprobs": None, "message": {"role": "assistant", "content": "",
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps(CHAT).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

CHILD = """
import gc, json, os, sys
url = sys.argv[1]
for name in sys.argv[2:]:
    __import__(name)
gc.freeze()

def private_mb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/smaps_rollup"))
    return (int(fields["Private_Clean"].split()[0]) + int(fields["Private_Dirty"].split()[0])) / 1024

r, w = os.pipe()
if os.fork() == 0:
    from openai import OpenAI
    client = OpenAI(base_url=url, api_key="k")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for _ in range(3):
        resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
        assert resp.choices[0].message.tool_calls[0].function.name == "f"
    os.write(w, json.dumps(private_mb()).encode())
    os._exit(0)
os.wait()
print(os.read(r, 100).decode())
"""


@pytest.fixture
def server_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}/v1"
    finally:
        proc.kill()
        proc.wait()


def _child_private_mb(url: str, *preload: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, url, *preload], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return float(json.loads(out.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps_rollup")
def test_a_child_forked_after_the_preload_builds_less_of_its_own(server_url: str) -> None:
    plain = _child_private_mb(server_url, "openai")
    warmed = _child_private_mb(server_url, "harnessrl.preload.openai")
    assert warmed < 0.6 * plain, (warmed, plain)  # ~8.5 MB against ~24 MB here


def test_the_preload_connects_to_nothing_but_loopback() -> None:
    code = """
import socket
connect = socket.socket.connect
def loopback_only(self, address):
    assert address[0] == "127.0.0.1", address
    return connect(self, address)
socket.socket.connect = loopback_only
import harnessrl.preload.openai
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
