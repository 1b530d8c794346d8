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
    """The engine's admin routes (load weights, weight version)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def load_weights(self, path: Path, version: int) -> int:
        """Make the engine serve the weights at `path` as `version`; returns the version it reports."""
        resp = await self._http.post("/admin/load_weights", json={"path": str(path), "version": version})
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return int(data["weight_version"])

    async def weight_version(self) -> int:
        """The version the engine serves now."""
        resp = await self._http.get("/admin/weight_version")
        resp.raise_for_status()
        return int(resp.json()["weight_version"])

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()


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
