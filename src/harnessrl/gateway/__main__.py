"""`python -m harnessrl.gateway`: run the gateway over a SQLite file or a PostgreSQL database."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import socket
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.types import ASGIApp

from harnessrl.defaults import DEFAULT_MAX_TOKENS, ENGINE_KEY_ENV, ROLLOUT_CACHE_SIZE, WAL_LIMIT_MB
from harnessrl.gateway import http
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.http import HEADER_TIMEOUT_S, TimedHttpProtocol
from harnessrl.store import Store, StoreError, open_store

log = logging.getLogger(__name__)

# Idle connections are closed after this; our clients expire them sooner (ControlClient after 2 s).
KEEP_ALIVE_S = 30
GRACEFUL_SHUTDOWN_S = 30  # on SIGTERM, streams still open after this are cut (their calls are recorded)


def server_config(
    app: ASGIApp, host: str, port: int, header_timeout_s: float = HEADER_TIMEOUT_S
) -> uvicorn.Config:
    """The uvicorn settings of a gateway: httptools with header size/time limits, idle keep-alive
    connections closed after `KEEP_ALIVE_S`, a bounded graceful shutdown; no `X-Forwarded-For`
    rewriting of the client's address (nothing reads it, and uvicorn's middleware for it costs each call)."""
    protocol = type("GatewayHttpProtocol", (TimedHttpProtocol,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level="warning", access_log=False,
                          proxy_headers=False, timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)  # fmt: skip


class GatewayServer(uvicorn.Server):
    """uvicorn's server, closing the store once the app has shut down: uvicorn re-raises SIGTERM after
    its graceful shutdown, so code after `run()` never runs on a signal."""

    def __init__(self, config: uvicorn.Config, store: Store) -> None:
        super().__init__(config)
        self.store = store

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Shut down as uvicorn does, then close the store (SQLite: the WAL is folded into the file)."""
        try:
            await super().shutdown(sockets)
        finally:
            self.store.close()


def parser() -> argparse.ArgumentParser:
    """The gateway's command line."""
    p = argparse.ArgumentParser(prog="harnessrl gateway", description=__doc__)
    p.add_argument("--store", required=True,
                   help="SQLite file of the store (created if missing), or a postgresql:// URL")  # fmt: skip
    p.add_argument("--upstream", default="http://127.0.0.1:8100", help="engine base URL")
    p.add_argument("--served-model", default="smollm2", help="model name sent to the engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--synchronous", choices=["NORMAL", "FULL"], default="NORMAL")
    p.add_argument(
        "--mode",
        choices=["passthrough", "tito"],
        default="passthrough",
        help="passthrough: the engine renders the chat template; tito: the gateway sends token IDs",
    )
    p.add_argument("--tokenizer", help="model directory with tokenizer.json (needed for --mode tito)")
    p.add_argument("--upstream-kind", choices=["openai", "sglang"], default="openai",
                   help="openai: builtin engine or vLLM's OpenAI server; sglang: SGLang's /generate (tito)")  # fmt: skip
    p.add_argument("--sglang-incremental-streaming", action="store_true",
                   help="the SGLang server runs with --incremental-streaming-output")  # fmt: skip
    p.add_argument(
        "--tool-parser", default="auto", help="tito: the tool-call format (auto: from the template)"
    )
    p.add_argument("--chat-template-kwargs", type=json.loads, default={},
                   help='tito: JSON object of chat template variables, e.g. {"enable_thinking": false}')  # fmt: skip
    p.add_argument(
        "--no-forward-seed",
        dest="forward_seed",
        action="store_false",
        help="drop a harness's seed (noted on the call) instead of sending it to the engine (vLLM-CPU)",
    )
    p.add_argument("--replica", action="append", default=[], help="another engine URL serving the same model")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds one engine try may take (streamed: between two pieces of the answer)")  # fmt: skip
    p.add_argument("--stream-open-timeout", type=float, default=30.0,
                   help="seconds a streamed engine try may wait for the answer's headers before a retry")  # fmt: skip
    p.add_argument("--call-timeout", type=float, default=600.0,
                   help="seconds all engine tries of one call may take together (so a pause can drain)")  # fmt: skip
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a client has to send a request's headers")  # fmt: skip
    p.add_argument("--body-timeout", type=float, default=http.BODY_TIMEOUT_S,
                   help="seconds a client has to send a request's body")  # fmt: skip
    p.add_argument("--rollout-cache-size", type=int, default=ROLLOUT_CACHE_SIZE,
                   help="rollouts kept in memory (least recently used out; the rest are read from the store)")  # fmt: skip
    p.add_argument(
        "--wal-limit-mb", type=float, default=WAL_LIMIT_MB, help="bound on the store's SQLite WAL file"
    )
    p.add_argument(
        "--model-map",
        action="append",
        default=[],
        metavar="NAME=SERVED",
        help="map a model name harnesses send to a served model name (repeatable)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME[=MODEL,...]",
        help="a policy (a served LoRA adapter) and the model names that choose it; the first is the "
        "default (repeatable)",
    )
    return p


def raise_open_files_limit() -> int:
    """Raise this process's open-file limit to its hard limit (each open stream holds two sockets: the
    harness's and the engine's; a soft limit of 1,024 would cap a gateway near 500 streams). Returns
    the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("event=nofile_not_raised soft=%d hard=%d error=%s", soft, hard, e)
    log.info("event=open_files_limit soft=%d", soft)
    return soft


def _problem(err: Any) -> str:
    """One settings error: the setting it names (none for a rule across settings), then what is wrong."""
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def parse_policies(flags: list[str]) -> dict[str, list[str]]:
    """`--policy NAME[=MODEL,...]` flags as {policy: model names} (the policy's own name always included)."""
    out: dict[str, list[str]] = {}
    for flag in flags:
        name, _, models = flag.partition("=")
        out[name] = [name, *(m for m in models.split(",") if m and m != name)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and serve until interrupted. The admin key comes from $HARNESSRL_ADMIN_KEY, the
    engine's key (if it has one) from $HARNESSRL_ENGINE_KEY: keys are not put on command lines, which
    every process on the machine can read."""
    args = parser().parse_args(argv)
    admin_key = os.environ.get("HARNESSRL_ADMIN_KEY", "")
    if len(admin_key) < 8:
        print("error: set HARNESSRL_ADMIN_KEY to an admin key of at least 8 characters", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_open_files_limit()
    bad = [m for m in args.model_map if "=" not in m]
    if bad:
        print(f"error: --model-map takes NAME=SERVED, got {bad[0]!r}", file=sys.stderr)
        return 2
    try:  # the settings' rules (tito needs a tokenizer, SGLang needs tito) live in GatewayConfig
        config = GatewayConfig(
            admin_key=admin_key,
            upstream_key=os.environ.get(ENGINE_KEY_ENV) or None,
            forward_seed=args.forward_seed,
            tool_parser=args.tool_parser,
            chat_template_kwargs=args.chat_template_kwargs,
            upstream_url=args.upstream,
            replica_urls=args.replica,
            served_model=args.served_model,
            model_map=dict(m.split("=", 1) for m in args.model_map),
            policies=parse_policies(args.policy),
            default_max_tokens=args.default_max_tokens,
            mode=args.mode,
            tokenizer_path=args.tokenizer,
            upstream_kind=args.upstream_kind,
            sglang_incremental_streaming=args.sglang_incremental_streaming,
            upstream_timeout_s=args.upstream_timeout,
            stream_open_timeout_s=args.stream_open_timeout,
            call_timeout_s=args.call_timeout,
            rollout_cache_size=args.rollout_cache_size,
        )
    except ValidationError as e:
        print("error: " + "; ".join(_problem(err) for err in e.errors()), file=sys.stderr)
        return 2
    http.BODY_TIMEOUT_S = args.body_timeout  # read_json's default, for every route
    try:
        store = open_store(args.store, synchronous=args.synchronous, wal_limit_mb=args.wal_limit_mb)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(config, store)
    try:  # GatewayServer closes the store on SIGTERM/SIGINT; this covers any other way out
        GatewayServer(server_config(app, args.host, args.port, args.header_timeout), store).run()
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
