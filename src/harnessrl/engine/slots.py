"""Which KV-cache slot holds which sequence, and what finished sequences left behind (the prefix cache).

Invariant: running sequences occupy slots 0..n_active-1, in admission order modulo swaps, so a batched
decode step works on a view of the cache. Slots n_active.. hold the K/V of finished sequences (their
`tokens`), reused when a new prompt starts with the same tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from harnessrl.modeling.cache import KVCache

if TYPE_CHECKING:
    from harnessrl.engine.scheduler import Sequence

# Reusing a prefix of n tokens costs a slot swap (copying K/V, cheap) instead of prefilling n tokens
# (a forward pass, expensive): worth it when n * REUSE_RATIO >= tokens moved.
REUSE_RATIO = 64


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search on C-level slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SlotTable:
    """Slot bookkeeping for the scheduler; moves K/V between slots to keep running ones packed."""

    def __init__(self, cache: KVCache, prefix_cache: bool = True) -> None:
        self.cache, self.prefix_cache = cache, prefix_cache
        n = cache.max_batch
        self.seqs: list[Sequence | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]  # tokens whose K/V a free slot holds
        self.last_used = [0.0] * n
        self.n_active = 0

    def active(self) -> list[Sequence]:
        """Running sequences in slot order (slot i holds element i)."""
        return [s for s in self.seqs[: self.n_active] if s is not None]

    def _swap(self, a: int, b: int, length: int) -> None:
        self.cache.swap(a, b, length)
        self.seqs[a], self.seqs[b] = self.seqs[b], self.seqs[a]
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.last_used[a], self.last_used[b] = self.last_used[b], self.last_used[a]

    def _best_match(self, prompt: list[int]) -> tuple[int, int]:
        """(slot, reusable prefix length) among free slots; the prefix leaves >= 1 token to prefill."""
        best, best_len = -1, 0
        for j in range(self.n_active, self.cache.max_batch):
            n = min(common_prefix_len(self.tokens[j], prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = j, n
        return best, best_len

    def admit(self, seq: Sequence, prompt: list[int]) -> tuple[int, int]:
        """Give `seq` slot n_active; return (slot, number of prompt tokens whose K/V are already there)."""
        target = self.n_active
        if target >= self.cache.max_batch:
            raise RuntimeError("no free KV slot")
        best, start = self._best_match(prompt) if self.prefix_cache else (-1, 0)
        moved = max(len(self.tokens[best]), len(self.tokens[target])) if best >= 0 else 0
        if best >= 0 and start * REUSE_RATIO >= moved:
            self._swap(best, target, moved)
        else:
            start = 0
            free = range(target, self.cache.max_batch)
            victim = min(free, key=lambda j: (len(self.tokens[j]) > 0, self.last_used[j]))
            if victim != target:  # keep target's cached K/V by moving it over the evicted slot
                self.cache.copy(target, victim, len(self.tokens[target]))
                self.tokens[victim], self.last_used[victim] = self.tokens[target], self.last_used[target]
        self.tokens[target] = []
        self.seqs[target] = seq
        self.n_active += 1
        return target, start

    def release(self, seq: Sequence, keep: bool = True) -> None:
        """Remove a running sequence; its K/V stay behind as prefix cache (if enabled and `keep`)."""
        i = next((k for k in range(self.n_active) if self.seqs[k] is seq), -1)
        if i < 0:
            return
        last = self.n_active - 1
        self.seqs[i] = None
        self.tokens[i] = seq.kv_tokens if (keep and self.prefix_cache) else []
        self.last_used[i] = time.monotonic()
        if i != last:
            other = self.seqs[last]
            other_len = other.kv_len if other is not None else 0
            if self.tokens[i]:
                self._swap(i, last, max(len(self.tokens[i]), other_len))
            else:
                self.cache.copy(last, i, other_len)
                self.seqs[i], self.seqs[last] = other, None
        self.n_active -= 1

    def clear_cache(self) -> None:
        """Forget every free slot's K/V (after a weight swap they are stale)."""
        for j in range(self.n_active, self.cache.max_batch):
            self.tokens[j] = []

    def cached_tokens(self) -> int:
        """Total tokens held as prefix cache."""
        return sum(len(t) for t in self.tokens[self.n_active :])
