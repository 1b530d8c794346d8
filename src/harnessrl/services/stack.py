"""The services of one run (or one `check`): the engine (builtin, a managed vLLM, or an external
server the run only uses) and the gateway replicas, started together and stopped with one `stop()`."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harnessrl.config import RunConfig
from harnessrl.defaults import ENGINE_KEY_ENV, MODEL_IMPL_ENV
from harnessrl.errors import ConfigError
from harnessrl.services.builtin import start_engine, start_gateway
from harnessrl.services.process import Service, free_port
from harnessrl.services.vllm import ManagedVLLM, VLLMSettings, find_vllm_python, untied_model_dir

log = logging.getLogger(__name__)

Notify = Callable[[str], None]


class EngineProcess(Protocol):
    """An engine the run started: where it answers, waiting until it does, stopping it."""

    @property
    def url(self) -> str: ...

    def wait_ready(self, notify: Notify) -> None: ...

    def stop(self) -> None: ...


@dataclass
class BuiltinEngine:
    """The builtin engine's process."""

    service: Service

    @property
    def url(self) -> str:
        return self.service.url

    def wait_ready(self, notify: Notify) -> None:
        """Block until it answers `/health`."""
        self.service.wait_healthy()

    def stop(self) -> None:
        self.service.stop()


@dataclass
class VLLMEngine:
    """A vLLM server the run manages; its warm-up takes minutes on a small CPU, so waiting says so."""

    vllm: ManagedVLLM
    start_timeout_s: float

    @property
    def url(self) -> str:
        return self.vllm.url

    def wait_ready(self, notify: Notify) -> None:
        """Start it and block until it answers, telling `notify` how long it has waited."""
        notify(f"starting vLLM (log: {self.vllm.log_path}); its warm-up takes minutes on a small CPU")
        waited = self.vllm.wait_healthy(
            self.start_timeout_s, progress=lambda s: notify(f"waiting for vLLM: {s:.0f}s")
        )
        notify(f"vLLM ready after {waited:.0f}s")

    def stop(self) -> None:
        self.vllm.stop()


@dataclass
class ServiceStack:
    """The engine and gateways one run uses: the processes it started, and the URLs of all of them
    (`gateway.urls`, `engine.url`: servers it did not start)."""

    engine_url: str
    gateway_urls: list[str]
    admin_key: str
    engine: EngineProcess | None = None
    engine_key: str | None = None  # the engine's key (`run_engine_key`; None: an external one without)
    gateways: list[Service] = field(default_factory=list)

    @property
    def vllm(self) -> ManagedVLLM | None:
        """The run's own vLLM server (engine.kind=vllm without a URL)."""
        return self.engine.vllm if isinstance(self.engine, VLLMEngine) else None

    def stop(self) -> None:
        """Stop every process the stack started: gateways first, then the engine."""
        for gateway in self.gateways:
            gateway.stop()
        if self.engine is not None:
            self.engine.stop()


def start_services(
    cfg: RunConfig, run_dir: Path, model_dir: Path, admin_key: str, notify: Notify | None = None
) -> ServiceStack:
    """Start the engine (the builtin one, or vLLM when `engine.kind=vllm` names no URL; an external one
    is only used) and the gateway (`gateway.replicas` processes); wait until all answer. `engine.model_impl`
    is exported to this process and its children (modeling/families.py's `model_impl` reads it)."""
    os.environ[MODEL_IMPL_ENV] = cfg.engine.model_impl
    engine_key = run_engine_key(cfg)
    engine = _engine_process(cfg, run_dir, model_dir, engine_key)
    engine_url = engine.url if engine is not None else str(cfg.engine.url)
    stack = ServiceStack(engine_url, list(cfg.gateway.urls), admin_key, engine, engine_key)
    mode = gateway_mode(cfg)
    chat = {"tool_parser": cfg.engine.tool_parser, "chat_template_kwargs": cfg.engine.chat_template_kwargs}
    upstream_s, call_s = cfg.gateway.timeouts(cfg.controller.harness_timeout_s)
    settings = {"--upstream-timeout": upstream_s, "--call-timeout": call_s,
                "--stream-open-timeout": cfg.gateway.stream_open_timeout_s, "--wal-limit-mb": cfg.gateway.wal_limit_mb}  # fmt: skip
    for r in range(0 if cfg.gateway.urls else cfg.gateway.replicas):  # >1 only on PostgreSQL (RunConfig)
        port = (cfg.gateway.port + r if cfg.gateway.port else 0) or free_port()
        stack.gateways.append(start_gateway(
            cfg.store or run_dir / "store.sqlite", engine_url, port, admin_key, run_dir / "logs",
            cfg.gateway.default_max_tokens, mode=mode, tokenizer=model_dir if mode == "tito" else None,
            upstream_kind="sglang" if cfg.engine.kind == "sglang" else "openai",
            name="gateway" if r == 0 else f"gateway{r}", rollout_cache_size=cfg.gateway.rollout_cache_size,
            upstream_key=engine_key, settings=settings, forward_seed=cfg.engine.kind != "vllm", chat=chat,
            policies=cfg.policy_models(),
        ))  # fmt: skip
    stack.gateway_urls = stack.gateway_urls or [g.url for g in stack.gateways]
    try:
        if engine is not None:
            engine.wait_ready(notify or log.info)
        for gateway in stack.gateways:
            gateway.wait_healthy()
    except BaseException:
        stack.stop()
        raise
    return stack


def _engine_process(cfg: RunConfig, run_dir: Path, model_dir: Path, key: str | None) -> EngineProcess | None:
    """The engine process the run starts (not yet healthy), with `key` required on every route but
    /health, or None for an external server."""
    e = cfg.engine
    if e.kind == "builtin":
        service = start_engine(model_dir, e.port or free_port(), run_dir / "logs", e.max_batch,
                               e.max_model_len, e.threads, e.device, e.dtype, e.matmul, api_key=key,
                               chat={"tool_parser": e.tool_parser, "chat_template_kwargs": e.chat_template_kwargs},
                               lora_adapters=bool(cfg.policies))  # fmt: skip
        return BuiltinEngine(service)
    if e.kind == "vllm" and not e.url:
        vllm = managed_vllm(cfg, run_dir, model_dir, key)
        vllm.start()
        return VLLMEngine(vllm, e.vllm_start_timeout_s)
    return None


def external_admin_key(cfg: RunConfig) -> str | None:
    """The admin key of gateways the run did not start (`gateway.urls`): $HARNESSRL_ADMIN_KEY."""
    if not cfg.gateway.urls:
        return None
    key = os.environ.get("HARNESSRL_ADMIN_KEY", "")
    if len(key) < 8:
        raise ConfigError(
            "gateway.urls: set HARNESSRL_ADMIN_KEY to the admin key those gateways were started with"
        )
    return key


def starts_engine(cfg: RunConfig) -> bool:
    """Whether the run starts its engine (the builtin one, or vLLM naming no URL) or uses a running one."""
    return cfg.engine.kind == "builtin" or (cfg.engine.kind == "vllm" and not cfg.engine.url)


def run_engine_key(cfg: RunConfig) -> str | None:
    """The engine key of the run: for an engine it starts, a fresh random one, or with `gateway.urls`
    (gateways it did not start, which must reach that engine) $HARNESSRL_ENGINE_KEY, the key those
    gateways were started with; for a running engine, $HARNESSRL_ENGINE_KEY if set (None: no key)."""
    key = os.environ.get(ENGINE_KEY_ENV, "")
    if not starts_engine(cfg):
        return key or None
    if not cfg.gateway.urls:
        return secrets.token_hex(16)
    if len(key) < 8:
        raise ConfigError(
            f"gateway.urls: set {ENGINE_KEY_ENV} (8 characters or more) to the engine key those gateways "
            "were started with (in their environment); the run starts the engine with it"
        )
    return key


def gateway_mode(cfg: RunConfig) -> str:
    """The gateway's mode for this engine: tito for SGLang (it returns token IDs only to token-ID
    prompts) and, unless `gateway.mode` is set, for vLLM: vLLM renders chats with the model's own
    template, which for SmolLM2 has no tools, so tool-calling harnesses need the gateway's rendering
    (the one the builtin engine uses) and its tool-call parsing."""
    if cfg.engine.kind == "sglang":
        return "tito"
    if cfg.engine.kind == "vllm" and "mode" not in cfg.gateway.model_fields_set:
        return "tito"
    return cfg.gateway.mode


def managed_vllm(cfg: RunConfig, run_dir: Path, model_dir: Path, api_key: str | None = None) -> ManagedVLLM:
    """The vLLM server of a run (not started): the untied view of `model_dir` under `<run_dir>/vllm/`,
    its log in `<run_dir>/logs/vllm.log`; with `api_key`, vLLM's own key check (VLLM_API_KEY: its
    /v1 routes; its dev-mode admin routes stay open, docs/security.md)."""
    e = cfg.engine
    settings = VLLMSettings(
        python=find_vllm_python(e.vllm_python), dtype=e.dtype, max_model_len=e.max_model_len,
        max_num_seqs=e.max_batch, threads=e.threads, device=e.device, kv_cache_gb=e.vllm_kv_cache_gb,
        enforce_eager=e.vllm_enforce_eager, seed=cfg.train.seed, extra_args=list(e.vllm_args),
    )  # fmt: skip
    served = untied_model_dir(model_dir, run_dir / "vllm" / "model")
    vllm = ManagedVLLM(settings, served, e.port or free_port(), run_dir / "logs", api_key=api_key)
    vllm.tokenizer_dir = model_dir
    return vllm


def vllm_restarter(vllm: ManagedVLLM, run_dir: Path) -> Callable[[Path], Awaitable[float]]:
    """The restart-on-new-weights sync of a managed vLLM: serve the untied view of the weights at the
    given path (`<run_dir>/vllm/model`, replaced each time)."""

    async def restart(path: Path) -> float:
        served = await asyncio.to_thread(
            untied_model_dir, path, run_dir / "vllm" / "model", vllm.tokenizer_dir
        )
        return await vllm.arestart(served)

    return restart
