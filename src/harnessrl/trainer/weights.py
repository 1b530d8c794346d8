"""Pushing new weights to the engine: write a safetensors directory, ask the engine to load it."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import save_model

log = logging.getLogger(__name__)


class EngineAdmin:
    """The builtin engine's admin routes: load weights (with a version), weight version, sleep/wake.

    `VLLMAdmin` and `SGLangAdmin` speak the same interface to those servers' admin routes, so the
    trainer's loop does not care which engine serves the model (`engine_admin` picks one by kind).
    """

    kind = "builtin"

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        resp = await self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            raise EngineAdminError(
                f"{self.kind} engine: {method} {path} answered {resp.status_code}: {resp.text[:300]}"
            )
        return resp

    async def load_weights(self, path: Path, version: int) -> int:
        """Make the engine serve the weights at `path` as `version`; returns the version it reports."""
        resp = await self._call("POST", "/admin/load_weights", json={"path": str(path), "version": version})
        data: dict[str, Any] = resp.json()
        return int(data["weight_version"])

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

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()


class EngineAdminError(RuntimeError):
    """An engine's admin route failed."""


class VLLMAdmin(EngineAdmin):
    """vLLM's OpenAI server, started with `VLLM_SERVER_DEV_MODE=1`, `--enable-sleep-mode` and the disk
    weight-transfer backend (`--weight-transfer-config '{"backend": "disk"}'`, vLLM >= 0.19).

    A weight load is: `POST /pause?mode=wait` (in-flight requests finish), `POST /update_weights` with
    `{"update_info": {"path": ...}}`, `POST /update_weight_version` (where it exists), `POST /reset_prefix_cache` (cached
    K/V came from the old weights), `POST /resume`. vLLM does not put a weight version in its answers:
    the gateway records the version it is told at resume. The path must be readable by the vLLM server.
    """

    kind = "vllm"

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        super().__init__(base_url, timeout_s)
        self._version = 0

    async def load_weights(self, path: Path, version: int) -> int:
        """Pause, load from disk, set the version, reset the prefix cache, resume."""
        await self._call("POST", "/pause", params={"mode": "wait"})
        try:
            await self._call("POST", "/update_weights", json={"update_info": {"path": str(path)}})
            # newer servers keep a version (GET /weight_info); older ones lack the route: not an error
            tagged = await self._http.post("/update_weight_version", json={"new_version": str(version)})
            if tagged.status_code >= 400 and tagged.status_code != 404:
                raise EngineAdminError(f"vllm engine: /update_weight_version answered {tagged.status_code}")
            await self._call("POST", "/reset_prefix_cache")
        finally:
            await self._call("POST", "/resume")
        self._version = version
        return version

    async def weight_version(self) -> int:
        """The version vLLM reports (`GET /weight_info`), else the last one loaded through this client."""
        resp = await self._http.get("/weight_info")
        if resp.status_code == 200:
            v = resp.json().get("weight_version")
            if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
                return int(v)
        return self._version

    async def sleep(self, level: int = 1) -> None:
        """`POST /sleep?level=N`: level 1 offloads the weights to CPU, level 2 discards them (reloaded by
        the next `update_weights`); the KV cache is discarded at both."""
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

    async def load_weights(self, path: Path, version: int) -> int:
        """Load from disk as `version`; SGLang answers `{"success": bool, "message": str}`."""
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


def engine_admin(kind: str, base_url: str, timeout_s: float = 600.0) -> EngineAdmin:
    """The admin client for an engine kind: "builtin", "vllm" or "sglang"."""
    kinds: dict[str, type[EngineAdmin]] = {"builtin": EngineAdmin, "vllm": VLLMAdmin, "sglang": SGLangAdmin}
    if kind not in kinds:
        raise ValueError(f"engine kind must be one of {sorted(kinds)}, not {kind!r}")
    return kinds[kind](base_url, timeout_s)


async def publish_weights(
    model: LlamaForCausalLM, engine: EngineAdmin, weights_dir: Path, version: int
) -> float:
    """Save `model` as `version` and load it into the engine; old versions are deleted. Returns seconds."""
    t0 = time.perf_counter()
    target = weights_dir / f"v{version}"
    save_model(model, target)
    loaded = await engine.load_weights(target, version)
    if loaded != version:
        raise RuntimeError(f"engine reports weight version {loaded} after loading {version}")
    for old in weights_dir.glob("v*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    seconds = time.perf_counter() - t0
    log.info("weights_published version=%d seconds=%.2f", version, seconds)
    return seconds
