"""A replay engine: a real engine process whose completions come from a prepared script.

It serves the engine protocol with the builtin engine's own routes, wire shapes and streaming code
(`harnessrl.engine.routes`, `.protocol`, `.streaming`): `/v1/chat/completions` (passthrough) and
`/v1/completions` with token-ID prompts (tito), `return_token_ids`, logprobs, SSE streaming, `/tokenize`.
Only generation differs: instead of sampling a model, the answer is chosen by the script, tokenized
with the real SmolLM2 tokenizer and ended with `<|im_end|>`, so the gateway records real prompt and
completion token IDs. Every scripted token has logprob 0.0 (the scripted policy is deterministic).
Stop strings, stop token IDs and `max_tokens` end an answer exactly as in the builtin engine.

The script (`POST /admin/script`) is a list of steps (see `Script`). A prompt's step is the number of assistant turns
it already holds (0 for a conversation's first call, 1 after one answer, ...); the step's answer is
its `text` followed by a call of the first of its `tools` the prompt declares, written in the chat
convention the gateway parses (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`). A prompt that
declares none of a step's tools (a harness's side call: a title, a summary) gets the `fallback` text.
Past the last step, the last step answers. There is no context limit beyond `--max-model-len`
(default one million tokens), so real harness prompts of any length fit.

    python bench/harnesses/replay_engine.py --port 8101 [--tokenizer DIR] [--max-model-len N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.chat import CHATML, SMOLLM2, render_chat, render_tool_call
from harnessrl.engine.core import EngineError
from harnessrl.engine.detok import StopChecker, TokenText
from harnessrl.engine.protocol import error_body
from harnessrl.engine.routes import EngineRoutes
from harnessrl.engine.sampling import SamplingParams
from harnessrl.engine.sequence import GenerationResult
from harnessrl.modeling.loading import load_tokenizer, smollm2_tokenizer_dir

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 1_000_000
_DECLARED_TOOL = re.compile(r'^\{"name": "((?:[^"\\]|\\.)*)"', re.MULTILINE)


class ToolStep(BaseModel):
    """A tool the step may call, with its arguments."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ScriptStep(BaseModel):
    """One scripted answer: text, then a call of the first declared tool among `tools` (if any).
    When the prompt declares none of `tools`, the answer is the script's fallback, or with
    `require_tool` false this step's text alone."""

    text: str = ""
    tools: list[ToolStep] = Field(default_factory=list)
    require_tool: bool = True


class Script(BaseModel):
    """The replay engine's policy: answers by conversation step, and the answer to side calls.
    `compact` writes tool calls as compact JSON (`{"name":"x","arguments":{...}}`), as models often
    do, instead of the spacing the chat template renders calls back with."""

    steps: list[ScriptStep] = Field(default_factory=list)
    fallback: str = "OK."
    compact: bool = False


def declared_tools(prompt_text: str) -> list[str]:
    """Names of the tools a rendered prompt's system turn declares (one JSON schema per line)."""
    head = prompt_text.split(SMOLLM2.im_end, 1)[0]
    return [json.loads(f'"{m}"') for m in _DECLARED_TOOL.findall(head)]


def prompt_step(prompt_text: str) -> int:
    """How many assistant turns the prompt already holds (its generation prompt not counted)."""
    opener = f"{SMOLLM2.im_start}assistant\n"
    n = prompt_text.count(opener)
    return max(n - 1, 0) if prompt_text.endswith(opener) else n


def scripted_answer(script: Script, prompt_text: str) -> tuple[str, str]:
    """The answer text for a prompt and what chose it (`step N`, `fallback`)."""
    if not script.steps:
        return script.fallback, "fallback"
    step = prompt_step(prompt_text)
    chosen = script.steps[min(step, len(script.steps) - 1)]
    if not chosen.tools:
        return chosen.text, f"step {step}"
    declared = set(declared_tools(prompt_text))
    for tool in chosen.tools:
        if tool.name in declared:
            return chosen.text + _tool_call(tool, script.compact), f"step {step}"
    if not chosen.require_tool:
        return chosen.text, f"step {step} (no tool)"
    return script.fallback, "fallback"


def _tool_call(tool: ToolStep, compact: bool) -> str:
    """A tool call in the chat convention, as the template renders it or in compact JSON."""
    if not compact:
        return render_tool_call(tool.name, tool.arguments)
    body = json.dumps(
        {"name": tool.name, "arguments": tool.arguments}, ensure_ascii=False, separators=(",", ":")
    )
    return f"{SMOLLM2.tool_call_open}{body}{SMOLLM2.tool_call_close}"


@dataclass
class ServedCall:
    """What the replay engine answered once (GET /admin/script lists them)."""

    prompt_tokens: int
    completion_tokens: int
    chosen_by: str
    finish_reason: str


class _Handle:
    """What `Engine.submit` returns: the streaming code sets `cancelled` when the client leaves."""

    cancelled = False


class ReplayEngine:
    """Duck-types `harnessrl.engine.core.Engine` for `EngineRoutes`, answering from the script."""

    def __init__(self, tokenizer_dir: Path, served_model_name: str = "replay",
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:  # fmt: skip
        self.model_dir = tokenizer_dir
        self.chat = CHATML  # SmolLM2's convention: how answers are parsed back (tool calls)
        self.adapters = None  # no LoRA adapters: every request is answered by the script
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.text = TokenText(self.tokenizer)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        eos = self.tokenizer.token_to_id(SMOLLM2.im_end)
        if eos is None:
            raise ValueError(f"the tokenizer in {tokenizer_dir} has no {SMOLLM2.im_end} token")
        self.eos_id: int = eos
        self.eos_ids = {eos}
        self.weight_version = 0
        self.script = Script()
        self.served: list[ServedCall] = []
        self.paused = False
        self._tasks: set[asyncio.Task[None]] = set()

    # the Engine surface EngineRoutes uses ----------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: there is no scheduler thread."""

    def shutdown(self) -> None:
        """Cancel streams still being sent."""
        for task in list(self._tasks):
            task.cancel()

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text as the builtin engine does."""
        return list(self.tokenizer.encode(text).ids)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        add_generation_prompt: bool = True,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
        """Render messages (+ tools) with SmolLM2's ChatML convention (no template variables) and tokenize
        the prompt."""
        text = render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def adapter_for(self, model: str | None) -> str | None:
        """No adapters here: the script answers every model name."""
        return None

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str = "max_tokens") -> int:
        """The builtin engine's length rule against `max_model_len`; returns the effective max_tokens."""
        if n_prompt == 0:
            raise EngineError("the prompt is empty; send at least one token", "prompt")
        limit = self.max_model_len
        max_tokens = limit - n_prompt if max_tokens is None else max_tokens
        if max_tokens < 1 or n_prompt + max_tokens > limit:
            raise EngineError(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{n_prompt + max(max_tokens, 1)} tokens.", param, "context_length_exceeded")  # fmt: skip
        return max_tokens

    def replay(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """The scripted completion of a prompt, ended by EOS, a stop string, a stop token or max_tokens."""
        vocab = self.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", "prompt")
        prompt_text = self.text.decode(prompt_ids, skip_special_tokens=False)
        answer, chosen_by = scripted_answer(self.script, prompt_text)
        planned = [*self.tokenizer.encode(answer, add_special_tokens=False).ids, self.eos_id]
        checker = StopChecker(self.text, params.stop, params.skip_special_tokens)
        out: list[int] = []
        finish, stop_reason, stop_text = "length", None, None
        for tok in planned:
            out.append(tok)
            hit = checker.add(tok)
            if (tok in self.eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                finish, stop_reason = "stop", tok if tok in params.stop_token_ids else None
                break
            if hit is not None:
                finish, stop_reason, stop_text = "stop", hit[1], hit[0]
                break
            if len(out) >= params.max_tokens:
                break
        text_ids = out[:-1] if finish == "stop" and not isinstance(stop_reason, str) else out
        text = stop_text if stop_text is not None else self.text.decode(text_ids, params.skip_special_tokens)
        self.served.append(ServedCall(len(prompt_ids), len(out), chosen_by, finish))
        log.info("event=replay prompt_tokens=%d completion_tokens=%d chosen_by=%s finish=%s",
                 len(prompt_ids), len(out), chosen_by, finish)  # fmt: skip
        return GenerationResult(prompt_ids, out, [0.0] * len(out), [[] for _ in out], text, finish,
                                stop_reason, self.weight_version, 0)  # fmt: skip

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One scripted completion."""
        return self.replay(prompt_ids, params)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_done: Callable[[GenerationResult | BaseException], None],
               on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None) -> _Handle:  # fmt: skip
        """Stream the scripted completion token by token (for `stream: true`)."""
        result = self.replay(prompt_ids, params)
        handle = _Handle()

        async def feed() -> None:
            for tok, lp in zip(result.token_ids, result.logprobs, strict=True):
                if handle.cancelled:
                    return
                if on_token is not None:
                    on_token(tok, lp, [])
                await asyncio.sleep(0)
            on_done(result)

        task = asyncio.get_running_loop().create_task(feed())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    def pause(self) -> None:
        """Accepted for the admin protocol; the replay engine has nothing to hold."""
        self.paused = True

    def resume(self) -> None:
        """See `pause`."""
        self.paused = False

    async def load_weights(self, path: str, version: int) -> int:
        """Records the version only: there are no weights."""
        self.weight_version = version
        return version

    async def sleep(self, level: int = 1) -> None:
        """Nothing to free."""

    async def wake_up(self) -> None:
        """Nothing to restore."""

    def stats(self) -> dict[str, object]:
        """Counters of what was served."""
        return {"served": len(self.served), "running": 0, "replay": True}


def build_app(engine: ReplayEngine) -> Starlette:
    """The builtin engine's routes over the replay engine, plus `/admin/script` (GET and POST)."""

    async def set_script(request: Request) -> Response:
        try:
            engine.script = Script.model_validate_json(await request.body())
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return JSONResponse(error_body(f"{where}: {err['msg']}", where), status_code=400)
        engine.served.clear()
        log.info("event=script_set steps=%d", len(engine.script.steps))
        return JSONResponse({"steps": len(engine.script.steps)})

    async def get_script(request: Request) -> Response:
        served = [vars(s) for s in engine.served]
        return JSONResponse({"script": engine.script.model_dump(), "served": served})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    routes = EngineRoutes(engine).routes()  # type: ignore[arg-type]
    routes += [Route("/admin/script", set_script, methods=["POST"]),
               Route("/admin/script", get_script, methods=["GET"])]  # fmt: skip
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    """Serve the replay engine until interrupted."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--tokenizer", help="model directory with tokenizer.json (default: SmolLM2's)")
    p.add_argument("--served-model-name", default="replay")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--script", help="JSON file with the initial script")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = ReplayEngine(Path(args.tokenizer) if args.tokenizer else smollm2_tokenizer_dir(),
                          args.served_model_name, args.max_model_len)  # fmt: skip
    if args.script:
        engine.script = Script.model_validate_json(Path(args.script).read_text())
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
