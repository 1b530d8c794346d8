"""The builtin engine's server: `build_app`, a background-thread runner, and the command line.

Run it with `python -m harnessrl.engine --model smollm2 --port 8100` (see `--help`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import threading
import time

import torch
import uvicorn

from harnessrl.defaults import ENGINE_KEY_ENV
from harnessrl.engine.config import EngineConfig
from harnessrl.engine.core import Engine
from harnessrl.engine.routes import build_app

__all__ = ["Engine", "EngineConfig", "ServerThread", "build_app", "main"]

log = logging.getLogger(__name__)


class ServerThread:
    """An engine app served by uvicorn on a background thread (tests, benchmarks, in-process demos)."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(engine), log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; returns once the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("engine server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(30)
        self._sock.close()


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    """EngineConfig from command-line flags (`--max-batch 16`, `--threads 2`, ...)."""
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m harnessrl.engine", description="harnessrl builtin engine")
    p.add_argument("--model", default=d.model, help="'smollm2' or a model directory")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences decoded together")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="prompt + completion tokens (default: the model's max_position_embeddings)")  # fmt: skip
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads (default: $OMP_NUM_THREADS, else every core)")  # fmt: skip
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    p.add_argument("--weight-version", type=int, default=d.weight_version)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens prefilled per step while other sequences decode")  # fmt: skip
    p.add_argument("--max-cached-tokens", type=int, default=d.max_cached_tokens,
                   help="KV budget in tokens: running sequences' prompt + max_tokens, then the prefix "
                        "cache (default: max-batch x max-model-len, at most 131072)")  # fmt: skip
    p.add_argument("--matmul", default=d.matmul, choices=["auto", "onednn", "aten"],
                   help="CPU linear layers: oneDNN-packed weights, F.linear, or auto (probe-checked)")  # fmt: skip
    p.add_argument("--tool-parser", default=d.tool_parser,
                   help="tool-call format: auto (from the chat template), hermes, llama3_json, none")  # fmt: skip
    p.add_argument("--chat-template-kwargs", type=json.loads, default={},
                   help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')  # fmt: skip
    p.add_argument("--lora-adapters", action="store_true",
                   help="serve LoRA adapters per request (a request's model names its adapter)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    args = vars(p.parse_args(argv))
    logging.basicConfig(
        level=args.pop("log_level").upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    return EngineConfig(**args)


def main(argv: list[str] | None = None) -> int:
    """Entry point: load the model and serve until interrupted; returns the exit status."""
    config = parse_args(argv)
    # Only the scheduler thread runs torch with `threads` threads; this thread and those the HTTP layer
    # starts keep one, so no second OpenMP team slows the decode steps (see `Engine.__init__`).
    torch.set_num_threads(1)
    engine = Engine(config)
    key = os.environ.get(ENGINE_KEY_ENV) or None  # not a flag: command lines are readable by every process
    if key is None:
        log.warning(
            "event=engine_without_key note=%r", f"any local process can call it; set {ENGINE_KEY_ENV}"
        )
    # the gateway's pool expires idle connections after 4 s, well before the server closes them
    uvicorn.run(
        build_app(engine, key), host=config.host, port=config.port, log_level="warning", timeout_keep_alive=30
    )
    return 0
