"""Configuration of the builtin engine server."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from harnessrl.chat.toolcalls import TOOL_PARSERS
from harnessrl.defaults import ENGINE_MAX_BATCH
from harnessrl.engine.scheduler import PREFILL_CHUNK

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Default KV budget in tokens when max_batch * max_model_len is larger: 16 sequences of 8,192 tokens
# (SmolLM2-135M: 46 KB a token in fp32, 6 GB). A long-context model (16k, 32k) then serves fewer of its
# longest sequences at once instead of claiming max_batch of them in memory.
DEFAULT_KV_TOKENS = 16 * 8192


@dataclass
class EngineConfig:
    """Everything `python -m harnessrl.engine` accepts (field names match the CLI flags)."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8100
    max_batch: int = ENGINE_MAX_BATCH
    max_model_len: int | None = None  # prompt + completion tokens; None: the model's max_position_embeddings
    threads: int | None = None  # torch intra-op threads; None = $OMP_NUM_THREADS, else all cores
    served_model_name: str | None = None
    prefix_cache: bool = True
    weight_version: int = 0
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per step while others decode (long prompts chunked)
    # KV memory budget in tokens: a sequence is admitted only while the running sequences' prompt +
    # max_tokens fit, and the prefix cache keeps what the running ones leave (least recently used goes
    # first). None: max_batch * max_model_len, at most DEFAULT_KV_TOKENS (but one whole sequence).
    max_cached_tokens: int | None = None
    # Linear layers on CPU: "onednn" (weights packed once, see modeling/packed.py), "aten" (F.linear, as
    # the trainer), "auto" (onednn when a startup probe finds its logprobs within 1e-4 of F.linear's)
    matmul: Literal["auto", "onednn", "aten"] = "auto"
    # tool-call format of chat completions: "auto" (detected from the model's chat template), "hermes",
    # "llama3_json", "qwen3_coder", "gemma4", "pythonic" or "none" (harnessrl.chat.toolcalls)
    tool_parser: str = "auto"
    # variables for the chat template on every call (a request's `chat_template_kwargs` overrides them)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # serve LoRA adapters by name, per request and unmerged (several policies in one run): a request
    # whose `model` names a loaded adapter is served by it (modeling/served_lora.py)
    lora_adapters: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.max_batch < 1 or (self.max_model_len is not None and self.max_model_len < 2):
            raise ValueError("max_batch must be >= 1 and max_model_len >= 2")
        if self.matmul not in ("auto", "onednn", "aten"):
            raise ValueError(f"matmul must be auto, onednn or aten, not {self.matmul!r}")
        if self.tool_parser != "auto" and self.tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_parser must be auto or one of {sorted(TOOL_PARSERS)}, not {self.tool_parser!r}"
            )
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if self.max_cached_tokens is not None and self.max_cached_tokens < (self.max_model_len or 2):
            raise ValueError("max_cached_tokens must hold at least one sequence of max_model_len tokens")

    def kv_budget(self, max_model_len: int) -> int:
        """The KV budget in tokens for the effective max_model_len (see `max_cached_tokens`)."""
        if self.max_cached_tokens is not None:
            if self.max_cached_tokens < max_model_len:
                raise ValueError(
                    f"max_cached_tokens ({self.max_cached_tokens}) must hold at least one sequence of "
                    f"max_model_len ({max_model_len}) tokens"
                )
            return self.max_cached_tokens
        return min(self.max_batch * max_model_len, max(max_model_len, DEFAULT_KV_TOKENS))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `dtype`."""
        return DTYPES[self.dtype]

    @property
    def num_threads(self) -> int:
        """Threads for torch: `threads`, else $OMP_NUM_THREADS (torch's own default reads it too), else
        every core this process may use."""
        if self.threads:
            return self.threads
        omp = os.environ.get("OMP_NUM_THREADS", "")
        if omp.isdigit() and int(omp) > 0:
            return int(omp)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
