"""The gateway's state, shared by every handler: its settings (`GatewayConfig`), the store, keys and
rollout cache, admission (in flight, pause), the call recorder, the engine replicas and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from starlette.requests import Request

from harnessrl.defaults import DEFAULT_MAX_TOKENS, ROLLOUT_CACHE_SIZE
from harnessrl.gateway.access import Access
from harnessrl.gateway.admission import Admission
from harnessrl.gateway.budget import ContextBudget
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.gateway.engine_client.sglang import SGLangUpstream
from harnessrl.gateway.engine_client.upstream import Upstream, UpstreamPool
from harnessrl.gateway.errors import APIError
from harnessrl.gateway.keys import KeyRing, new_secret
from harnessrl.gateway.metrics import Metrics
from harnessrl.gateway.recording import CallRecorder
from harnessrl.schema import Rollout
from harnessrl.store import Store

log = logging.getLogger(__name__)

POLICY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # config.sections' rule, repeated (no import)

PAUSED_META = "gateway_paused"  # "1" between a pause and its resume
WEIGHT_VERSION_META = "gateway_weight_version"  # the engine's weight version the last resume named


class GatewayConfig(BaseModel):
    """Settings of one gateway process."""

    admin_key: str = Field(min_length=8)
    upstream_url: str = "http://127.0.0.1:8100"
    upstream_key: str | None = (
        None  # the engine's key, sent to every replica (the run's builtin engine has one)
    )
    replica_urls: list[str] = Field(
        default_factory=list
    )  # more replicas of the same model (sticky per rollout)
    served_model: str = "smollm2"
    model_map: dict[str, str] = Field(default_factory=dict)  # harness model name -> served model name
    # several policies: policy name -> the model names that choose it; each is served by the engine's
    # LoRA adapter of that name. A call naming none of them goes to the first policy (the default).
    policies: dict[str, list[str]] = Field(default_factory=dict)
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    pause_wait_s: float = 30.0  # how long a call waits for resume before getting 429
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_timeout_s: float = 600.0  # one try: the whole answer, or between two streamed pieces
    upstream_retries: int = 3
    stream_open_timeout_s: float = 30.0  # one streamed try: until the engine's headers (sent at once)
    call_timeout_s: float = 600.0  # every try of one call together, on all replicas (a pause can drain)
    rollout_cache_size: int = Field(default=ROLLOUT_CACHE_SIZE, ge=1)  # rollouts kept in memory (LRU out)
    mode: Literal["passthrough", "tito"] = "passthrough"
    tokenizer_path: str | None = None  # model directory with tokenizer.json; required for tito
    # tito: how completions' tool calls are parsed ("auto": from the model's template) and the chat
    # template's extra variables on every call (a request's `chat_template_kwargs` overrides them)
    tool_parser: str = "auto"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # wire of the upstream: "openai" = the engine protocol (builtin engine, vLLM's OpenAI server);
    # "sglang" = SGLang's native /generate (token IDs in and out; needs tito mode)
    upstream_kind: Literal["openai", "sglang"] = "openai"
    # send a harness's `seed` to the engine; off for vLLM-CPU (its engine core dies under many concurrent
    # seeded requests): the seed is dropped and noted on the call (`seed_dropped`)
    forward_seed: bool = True
    sglang_incremental_streaming: bool = False  # the SGLang server runs --incremental-streaming-output

    @model_validator(mode="after")
    def _mode_rules(self) -> GatewayConfig:
        """The one place these rules are checked (the gateway's command line builds this model too)."""
        if self.mode == "tito" and not self.tokenizer_path:
            raise ValueError("tito mode needs tokenizer_path (a model directory with tokenizer.json)")
        bad = [p for p in self.policies if not POLICY_NAME.match(p)]
        if bad:
            raise ValueError(
                f"policies: {bad[0]!r} is not a valid policy name (letters, digits, '.', '_', '-')"
            )
        if self.upstream_kind == "sglang" and self.mode != "tito":
            raise ValueError(
                "upstream_kind 'sglang' needs mode 'tito' (SGLang returns token IDs only from /generate)"
            )
        return self


class Gateway:
    """The state the handlers share: store, access (keys, rollout cache), admission (in flight, pause),
    the call recorder, the engine replicas and metrics. The model API's handlers are `calls.ModelCalls`
    and `model_api.ModelAPIRoutes`, the control API's `control.ControlRoutes`; `app.create_app` builds
    the app from their route tables."""

    def __init__(self, config: GatewayConfig, store: Store, upstreams: list[Upstream] | None = None) -> None:
        self.config = config
        self.store = store
        self._policy_of_model = {m: p for p, models in config.policies.items() for m in (p, *models)}
        self.keys = KeyRing(store.set_meta_if_absent("key_secret", new_secret()))
        # A store other gateway replicas write too (PostgreSQL): their attempts, state changes and calls
        # would not reach this process's memory, so rollouts and recent calls are read from the store.
        shared = store.pushes_events
        self.access = Access(config.admin_key, self.keys, store, 0 if shared else config.rollout_cache_size)
        urls = [config.upstream_url, *config.replica_urls]
        kind = SGLangUpstream if config.upstream_kind == "sglang" else Upstream
        built = [kind(f"engine{i}", url, timeout_s=config.upstream_timeout_s, max_retries=config.upstream_retries,
                      open_timeout_s=config.stream_open_timeout_s, api_key=config.upstream_key)
                 for i, url in enumerate(urls)]  # fmt: skip
        for u in built:
            if isinstance(u, SGLangUpstream):
                u.incremental_streaming = config.sglang_incremental_streaming
        self.upstreams = UpstreamPool(upstreams or list(built), call_timeout_s=config.call_timeout_s)
        # what the trainer last told the gateways (pause, the engine's weight version), kept in the store
        # so that a replica restarted during a weight update starts paused, with the version it must record
        saved_version = store.get_meta(WEIGHT_VERSION_META)
        self.weight_version: int | None = int(saved_version) if saved_version is not None else None
        self.tito: TitoTokenizer | None = None
        if config.mode == "tito" and config.tokenizer_path:  # GatewayConfig requires the path for tito
            self.tito = TitoTokenizer.from_dir(
                config.tokenizer_path,
                tool_parser=config.tool_parser,
                template_kwargs=config.chat_template_kwargs,
            )
        self.admission = Admission(config.pause_wait_s)
        if store.get_meta(PAUSED_META) == "1":
            self.admission.hold()
            log.info("event=gateway_starts_paused weight_version=%s", self.weight_version)
        self.metrics = Metrics()
        self.recorder = CallRecorder(store, self.metrics, lambda: self.weight_version, remember=not shared)
        self.budget = ContextBudget(self.tito)  # max_tokens vs the served model's context
        self.metrics.gauge(
            "harnessrl_gateway_paused", "1 while the gateway holds new calls.", lambda: float(self.paused)
        )
        self.metrics.gauge(
            "harnessrl_gateway_in_flight", "Model calls being served.", lambda: float(self.in_flight)
        )
        self._event_seq = asyncio.Condition()

    def require_admin(self, request: Request) -> None:
        """Raise 401/403 unless the request carries the admin key."""
        self.access.require_admin(request)

    def rollout_for(self, request: Request, path_rollout: str | None) -> Rollout:
        """The rollout a model-API request acts for (see `Access.rollout_for`)."""
        return self.access.rollout_for(request, path_rollout)

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout from the cache after the control API changed it."""
        self.access.rollouts.forget(rollout_id)

    def served_model(self, requested: str) -> str:
        """The model that serves a request naming `requested` (any name is served)."""
        return self.config.model_map.get(requested, self.config.served_model)

    def policy_model_names(self) -> list[str]:
        """Every model name that chooses a policy (the policies' own names and their `models`)."""
        return list(self._policy_of_model)

    def policy_for(self, requested: str, route_policy: str | None = None) -> str | None:
        """The policy serving a call (None when the run has no policies): the one the route names
        (`/p/<name>/v1/...`; an unknown name is a 404), else the one whose model names include
        `requested`, else the first (the default)."""
        policies = self.config.policies
        if route_policy is not None:
            if route_policy not in policies:
                known = ", ".join(policies) or "none (this gateway serves no policies)"
                raise APIError(
                    404, f"no policy {route_policy!r} in the route /p/{route_policy}/; known: {known}"
                )
            return route_policy
        if not policies:
            return None
        return self._policy_of_model.get(requested, next(iter(policies)))

    def route(self, requested: str, route_policy: str | None = None) -> tuple[str, str | None]:
        """(the model name sent to the engine, the policy) of a call naming `requested`: with policies,
        the policy's adapter name (vLLM's convention: a request names its LoRA adapter as its model)."""
        policy = self.policy_for(requested, route_policy)
        return (policy if policy is not None else self.served_model(requested)), policy

    # pause ----------------------------------------------------------------------------------------
    async def pause(self, drain_timeout_s: float, preempt: bool = False) -> bool:
        """Stop admitting calls and wait for in-flight ones; True if drained (see `Admission.pause`).
        The pause is kept in the store, for a replica that restarts before the resume."""
        self.store.set_meta(PAUSED_META, "1")
        return await self.admission.pause(drain_timeout_s, preempt)

    def resume(self, weight_version: int | None) -> None:
        """Admit calls again, optionally recording the engine's new weight version (both kept in the
        store, see `pause`)."""
        if weight_version is not None:
            self.weight_version = weight_version
            self.store.set_meta(WEIGHT_VERSION_META, str(weight_version))
        self.store.set_meta(PAUSED_META, "0")
        self.admission.resume()

    @property
    def paused(self) -> bool:
        """True while new calls are held back."""
        return self.admission.paused

    @property
    def in_flight(self) -> int:
        """Model calls being served."""
        return self.admission.in_flight

    @property
    def preempted_calls(self) -> int:
        """Non-streamed calls cut by preempting pauses (and sent again) so far."""
        return self.admission.preempted_calls

    # errors and events ----------------------------------------------------------------------------
    def count_error(self, status: int) -> None:
        """Count a request answered with an error status."""
        self.metrics.inc(
            "harnessrl_gateway_errors_total", "Requests answered with an error.", status=str(status)
        )

    async def notify_events(self) -> None:
        """Wake event-stream readers: a rollout changed state."""
        async with self._event_seq:
            self._event_seq.notify_all()

    async def wait_events(self, timeout_s: float) -> None:
        """Wait until `notify_events` or the timeout (a cancel always propagates: `asyncio.timeout`, see
        `Admission`)."""
        async with self._event_seq:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._event_seq.wait()
