"""What the scheduler works on: a sequence being generated (`EngineSequence`), its finished result
(`GenerationResult`), work queued between decode steps (`WeightLoad`, `Maintenance`) and the counters
(`Stats`). Plain data, shared by the scheduler and its KV slot bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harnessrl.engine.detok import StopChecker, TokenText
from harnessrl.engine.sampling import SamplingParams, make_generator
from harnessrl.modeling.lora import LoraSpec
from harnessrl.modeling.lora_swap import LoraSwap


@dataclass
class GenerationResult:
    """A finished sequence: exact token ids, their logprobs, and the text."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None
    weight_version: int
    cached_tokens: int
    adapter: str | None = None  # the LoRA adapter that served it (None: the base weights)


class EngineSequence:
    """One request being generated; `on_done` is called from the scheduler thread."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_done: Callable[[GenerationResult | BaseException], None],
        text: TokenText,
        device: torch.device,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> None:
        self.prompt_ids, self.params, self.on_done = prompt_ids, params, on_done
        self.on_token = on_token  # streaming: called from the scheduler thread for every sampled token
        self.generator = make_generator(params.seed, device)
        self.stop_checker = StopChecker(text, params.stop, params.skip_special_tokens)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stop_text: str | None = None
        self.cached_tokens = 0
        self.kv_len = 0  # positions of this sequence's slot holding valid K/V
        self.cancelled = False
        self.adapter = params.adapter  # the served LoRA adapter (None: the base weights)

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the KV cache yet (chunked prefill in progress)."""
        return self.kv_len < len(self.prompt_ids)

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose K/V are in the cache (the last sampled token is not fed yet)."""
        return (self.prompt_ids + self.output_ids)[: self.kv_len]


@dataclass
class WeightLoad:
    """A queued weight swap, applied when no sequence is running: `read` returns the state dict then (or
    a `LoraSwap`: the adapter merged into the weights held is replaced in place)."""

    read: Callable[[], dict[str, torch.Tensor] | LoraSwap]
    version: int
    on_done: Callable[[int | BaseException], None]


@dataclass
class AdapterLoad:
    """A queued swap of one served LoRA adapter (`name`, PEFT tensors), applied like a weight load."""

    name: str
    read: Callable[[], tuple[LoraSpec, dict[str, torch.Tensor]]]
    version: int
    on_done: Callable[[int | BaseException], None]


@dataclass
class Maintenance:
    """Work that must run while no sequence is in flight (sleep, wake-up); queued like a weight load."""

    name: str
    fn: Callable[[], object]
    on_done: Callable[[object], None]


@dataclass
class Stats:
    """Counters exposed at GET /admin/stats."""

    max_batch_seen: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    weight_loads: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sample_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)
