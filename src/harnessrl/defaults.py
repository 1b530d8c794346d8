"""Defaults shared by a run's config (`harnessrl.config`) and the services' own command lines (the
engine's `EngineConfig`, the gateway's `GatewayConfig`), defined once here. Imports the standard
library only."""

from __future__ import annotations

import os
from pathlib import Path

# sequences the builtin engine decodes together (its KV cache is reserved as they need it)
ENGINE_MAX_BATCH = 32
# completion budget of a call whose request sets none (and whose rollout sets none)
DEFAULT_MAX_TOKENS = 256
# rollouts a gateway keeps in memory (their keys and state; least recently used out, re-read from the store)
ROLLOUT_CACHE_SIZE = 50_000
# LoRA (train.lora): the linear projections of a decoder layer an adapter targets by default
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the environment variable that carries the builtin engine's key (to the engine, and to the gateway that
# calls it): every route but /health needs it when set
ENGINE_KEY_ENV = "HARNESSRL_ENGINE_KEY"
# Bound on the SQLite store's write-ahead log (MB): folded in every few seconds, TRUNCATEd at half.
WAL_LIMIT_MB = 512.0
# `engine.model_impl` ("auto", "builtin", "transformers") as every process of a run reads it
# (harnessrl.modeling.families.model_impl): set by the run's service stack, inherited by the engine
MODEL_IMPL_ENV = "HARNESSRL_MODEL_IMPL"


def cache_dir() -> Path:
    """Where converted models and tokenizers are cached: $HARNESSRL_CACHE, else $XDG_CACHE_HOME/harnessrl,
    else ~/.cache/harnessrl (docs/operations.md)."""
    env = os.environ.get("HARNESSRL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")  # the XDG spec: only an absolute path counts
    return (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "harnessrl"
