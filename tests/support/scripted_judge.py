"""A judge model for tests: an OpenAI-compatible chat endpoint over real HTTP on loopback whose answers a
test scripts (`ScriptedJudge`), and a pytest fixture that starts as many as a test needs. It keeps every
request body, so a test can read what the judge was sent."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.gateway import ThreadServer

# request body -> the judge's text, or an HTTP status, or (text, the choice's `logprobs`)
Script = Callable[[dict[str, Any]], str | int | tuple[str, Any]]
StartJudge = Callable[[Script], tuple["ScriptedJudge", str]]

FENCE_RE = re.compile(r"<(answer-[0-9a-f]{16})( candidate=(\d+))? chars=\d+>\n(.*?)\n</\1>", re.S)


class ScriptedJudge:
    """An OpenAI-compatible chat endpoint whose answers a test scripts; it keeps every request."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        reply = self.script(body)
        if isinstance(reply, int):
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=reply)
        text, logprobs = reply if isinstance(reply, tuple) else (reply, None)
        choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return JSONResponse({"id": "j", "object": "chat.completion", "model": body["model"],
                             "choices": [choice]})  # fmt: skip


def candidates(body: dict[str, Any]) -> list[tuple[int, str]]:
    """The fenced answers of a judge request, as (candidate number or 0, text), in the order shown."""
    user = body["messages"][-1]["content"]
    return [(int(m.group(3) or 0), m.group(4)) for m in FENCE_RE.finditer(user)]


def scripted_judges() -> Iterator[StartJudge]:
    """A fixture's body: start scripted judges on loopback with `start(script)` -> (the judge, its base
    URL ending in /v1); they stop when the fixture ends."""
    servers: list[ThreadServer] = []

    def start(script: Script) -> tuple[ScriptedJudge, str]:
        judge = ScriptedJudge(script)
        srv = ThreadServer(judge.app).__enter__()
        servers.append(srv)
        return judge, f"{srv.url}/v1"

    yield start
    for s in servers:
        s.__exit__()
