"""The generic path's engine cache: one transformers cache object per scheduler slot.

transformers' `DynamicCache` keeps, per layer, the keys/values of an attention layer (a sliding one
trims its window) or the causal-conv and recurrent state of a linear-attention layer (Qwen3.5's Gated
DeltaNet). `SlotCaches` gives the scheduler's `SlotTable` the same operations as the builtin `KVCache`
(copy/swap/release by slot, free/allocate for sleep), moving cache objects instead of tensor rows.

Prefix reuse: an attention-only model's cache can be cut back to any prefix (`crop`), so a later prompt
sharing n tokens continues from them. A recurrent state cannot be cut back: for a hybrid model a slot is
reused only when the new prompt extends ALL the tokens it holds (the multi-turn agent case: the next call
repeats the previous prompt + completion), which continues from exactly that state; any shorter match is
refused (`reusable_prefix` returns 0) and the prompt is prefilled from scratch. Never a wrong reuse.
"""

from __future__ import annotations

from typing import Any

import torch


def _seq_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _cache_bytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


class SlotCaches:
    """`max_batch` slots, each None or a transformers cache holding a sequence's first tokens."""

    def __init__(self, max_batch: int, max_len: int, hybrid: bool) -> None:
        self.max_batch, self.max_len, self.hybrid = max_batch, max_len, hybrid
        self.caches: list[Any] = [None] * max_batch
        self._allocated = True

    @property
    def allocated(self) -> bool:
        """False between `free` and `allocate`."""
        return self._allocated

    @property
    def nbytes(self) -> int:
        """Bytes the slots' caches hold now."""
        return sum(_cache_bytes(c) for c in self.caches if c is not None)

    def reusable_prefix(self, slot: int, n: int, held: int) -> int:
        """How many of the `n` matching tokens of a slot holding `held` tokens a new prompt may reuse:
        all of them where the cache can be cut back (or is not cut at all), else 0."""
        if self.caches[slot] is None:
            return 0
        return n if (not self.hybrid or n == held) else 0

    def continue_from(self, slot: int, start: int) -> Any:
        """The cache to run a slot's tokens from position `start` on: None (a fresh one) at 0, else its
        cache holding exactly `start` tokens (cut back to them when it holds more and can be)."""
        cache = self.caches[slot]
        if start == 0 or cache is None:
            if start:
                raise RuntimeError(f"slot {slot} holds no cache to continue from position {start}")
            return None
        held = _seq_length(cache)
        if held != start:
            if self.hybrid or held < start:
                raise RuntimeError(f"slot {slot} holds {held} tokens, cannot continue from {start}")
            cache.crop(start)
        return cache

    def copy(self, src: int, dst: int, length: int) -> None:
        """Move slot `src`'s cache to `dst` (the scheduler never reads `src` again before refilling it)."""
        if src != dst:
            self.caches[dst] = self.caches[src] if length > 0 else None
            self.caches[src] = None

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the caches of slots `a` and `b`."""
        self.caches[a], self.caches[b] = self.caches[b], self.caches[a]

    def release(self, slot: int, start: int, end: int | None = None) -> int:
        """Drop what slot `slot` holds past `start` tokens (all of it at 0, or where it cannot be cut);
        returns the bytes given back (estimated)."""
        cache = self.caches[slot]
        if cache is None:
            return 0
        before = _cache_bytes(cache)
        if start == 0 or self.hybrid:
            if start == 0 or _seq_length(cache) > start:
                self.caches[slot] = None
                return before
            return 0
        if _seq_length(cache) > start:
            cache.crop(start)
        return before - _cache_bytes(cache)

    def free(self) -> None:
        """Forget every slot's cache (engine sleep)."""
        self.caches = [None] * self.max_batch
        self._allocated = False

    def allocate(self) -> None:
        """Admit caches again after `free`."""
        self._allocated = True
