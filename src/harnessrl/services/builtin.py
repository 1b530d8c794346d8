"""Starting harnessrl's own servers, the builtin engine and the gateway, as child processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harnessrl.defaults import ENGINE_KEY_ENV
from harnessrl.services.process import Service, start_service


def start_engine(
    model_dir: Path,
    port: int,
    log_dir: Path,
    max_batch: int,
    max_model_len: int | None,
    threads: int | None,
    device: str = "cpu",
    dtype: str = "float32",
    matmul: str = "auto",
    api_key: str | None = None,
    chat: dict[str, Any] | None = None,
    lora_adapters: bool = False,
) -> Service:
    """The builtin engine serving `model_dir` (`max_model_len` None: the model's own context); with
    `api_key` every route but /health requires it (passed in the environment, not on the command line);
    `lora_adapters`: LoRA adapters served per request (several policies)."""
    args = ["harnessrl.engine", "--model", str(model_dir), "--port", str(port), "--max-batch", str(max_batch)]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--device", device, "--dtype", dtype, "--matmul", matmul]
    if threads:
        args += ["--threads", str(threads)]
    args += chat_args(chat)
    if lora_adapters:
        args.append("--lora-adapters")
    return start_service("engine", args, port, log_dir, env={ENGINE_KEY_ENV: api_key} if api_key else None)


def start_gateway(
    store_path: Path | str,
    upstream_url: str,
    port: int,
    admin_key: str,
    log_dir: Path,
    default_max_tokens: int,
    mode: str = "passthrough",
    tokenizer: Path | None = None,
    upstream_kind: str = "openai",
    name: str = "gateway",
    rollout_cache_size: int | None = None,
    upstream_key: str | None = None,
    settings: dict[str, float] | None = None,
    forward_seed: bool = True,
    chat: dict[str, Any] | None = None,
    policies: dict[str, list[str]] | None = None,
) -> Service:
    """The gateway over the store `store_path`: a SQLite file, or a postgresql:// URL (`name`: its
    service and log name, e.g. `gateway1` for a second replica); `policies`: policy -> the model names
    that choose it (the first policy is the default)."""
    args = ["harnessrl.gateway", "--store", str(store_path), "--upstream", upstream_url, "--port", str(port)]
    args += [
        "--default-max-tokens",
        str(default_max_tokens),
        "--mode",
        mode,
        "--upstream-kind",
        upstream_kind,
    ]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    if rollout_cache_size is not None:
        args += ["--rollout-cache-size", str(rollout_cache_size)]
    args += chat_args(chat)
    for flag, value in (settings or {}).items():  # e.g. {"--call-timeout": 240.0}
        args += [flag, f"{value:g}"]
    if not forward_seed:
        args.append("--no-forward-seed")
    for policy, models in (policies or {}).items():
        args += ["--policy", f"{policy}={','.join(models)}"]
    env = {"HARNESSRL_ADMIN_KEY": admin_key, **({ENGINE_KEY_ENV: upstream_key} if upstream_key else {})}
    return start_service(name, args, port, log_dir, env=env)


def chat_args(chat: dict[str, Any] | None) -> list[str]:
    """`--tool-parser` and `--chat-template-kwargs` from {"tool_parser": ..., "chat_template_kwargs": ...}
    (the engine's and the gateway's flags of the same names)."""
    if not chat:
        return []
    args = ["--tool-parser", str(chat.get("tool_parser", "auto"))]
    if chat.get("chat_template_kwargs"):
        args += ["--chat-template-kwargs", json.dumps(chat["chat_template_kwargs"])]
    return args
