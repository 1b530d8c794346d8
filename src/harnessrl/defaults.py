"""Defaults shared by a run's config (`harnessrl.config`) and the services' own command lines (the
engine's `EngineConfig`, the gateway's `GatewayConfig`), defined once here. Imports nothing."""

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
