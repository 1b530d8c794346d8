"""Which KV-cache slot holds which sequence, and what finished sequences left behind (the prefix cache).

Invariant: running sequences occupy slots 0..n_active-1, in admission order modulo swaps, so a batched
decode step works on a view of the cache. Slots n_active.. hold the K/V of finished sequences (their
`tokens`), reused when a new prompt starts with the same tokens.

Memory: a slot's pages become resident as positions are written and stay so until released. `touched[j]`
bounds the positions of slot j that may be resident; whenever a slot comes to hold fewer valid positions
than that (eviction, reuse by a shorter sequence, cache cleared) the pages past its valid positions are
given back (`KVCache.release`), so the cache holds about the tokens it serves rather than every slot's
longest past sequence (which, with 16k-token prompts, is most of the machine's memory).
"""

from __future__ import annotations

import time

from harnessrl.engine.sequence import EngineSequence
from harnessrl.modeling.cache import KVCache

# Reusing a prefix of n tokens costs a slot swap (copying K/V, cheap) instead of prefilling n tokens
# (a forward pass, expensive): worth it when n * REUSE_RATIO >= tokens moved.
REUSE_RATIO = 64
# Stale positions a slot may keep resident before they are released (fewer: not worth the syscalls and
# the page faults of writing them again).
RELEASE_MIN_POSITIONS = 256


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
        self.seqs: list[EngineSequence | None] = [None] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]  # tokens whose K/V a free slot holds
        self.owner: list[str | None] = [None] * n  # the LoRA adapter those K/V were computed with
        self.last_used = [0.0] * n
        self.touched = [0] * n  # positions of each slot that may hold resident pages
        self.n_active = 0

    def active(self) -> list[EngineSequence]:
        """Running sequences in slot order (slot i holds element i)."""
        return [s for s in self.seqs[: self.n_active] if s is not None]

    def _swap(self, a: int, b: int, length: int) -> None:
        self.cache.swap(a, b, length)
        self._copied(a, length)
        self._copied(b, length)
        self.seqs[a], self.seqs[b] = self.seqs[b], self.seqs[a]
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.owner[a], self.owner[b] = self.owner[b], self.owner[a]
        self.last_used[a], self.last_used[b] = self.last_used[b], self.last_used[a]

    def _copy(self, src: int, dst: int, length: int) -> None:
        self.cache.copy(src, dst, length)
        self._copied(dst, length)

    def _copied(self, slot: int, length: int) -> None:
        if length > 0:
            self.touched[slot] = max(self.touched[slot], length)

    def _trim(self, slot: int, keep: int) -> None:
        """Release the pages of `slot` past its first `keep` positions (those hold no live K/V)."""
        if self.touched[slot] - keep >= RELEASE_MIN_POSITIONS:
            self.cache.release(slot, keep, self.touched[slot])
            self.touched[slot] = keep

    def _best_match(self, prompt: list[int], adapter: str | None = None) -> tuple[int, int]:
        """(slot, reusable prefix length) among free slots computed with the same LoRA adapter; the
        prefix leaves >= 1 token to prefill."""
        best, best_len = -1, 0
        for j in range(self.n_active, self.cache.max_batch):
            if self.owner[j] != adapter:
                continue
            n = min(common_prefix_len(self.tokens[j], prompt), len(prompt) - 1)
            n = self.cache.reusable_prefix(j, n, len(self.tokens[j]))  # a recurrent state: all or nothing
            if n > best_len:
                best, best_len = j, n
        return best, best_len

    def admit(self, seq: EngineSequence, prompt: list[int]) -> tuple[int, int]:
        """Give `seq` slot n_active; return (slot, number of prompt tokens whose K/V are already there)."""
        target = self.n_active
        if target >= self.cache.max_batch:
            raise RuntimeError("no free KV slot")
        best, start = self._best_match(prompt, seq.adapter) if self.prefix_cache else (-1, 0)
        moved = max(len(self.tokens[best]), len(self.tokens[target])) if best >= 0 else 0
        if best >= 0 and start * REUSE_RATIO >= moved:
            self._swap(best, target, moved)
            self._trim(best, len(self.tokens[best]))
        else:
            start = 0
            free = range(target, self.cache.max_batch)
            victim = min(free, key=lambda j: (len(self.tokens[j]) > 0, self.last_used[j]))
            if victim != target:  # keep target's cached K/V by moving it over the evicted slot
                self._copy(target, victim, len(self.tokens[target]))
                self.tokens[victim], self.last_used[victim] = self.tokens[target], self.last_used[target]
                self.owner[victim] = self.owner[target]
                self._trim(victim, len(self.tokens[victim]))
        self._trim(target, start)
        self.tokens[target] = []
        self.seqs[target] = seq
        self.n_active += 1
        return target, start

    def release(self, seq: EngineSequence, keep: bool = True, written: int = 0) -> None:
        """Remove a running sequence; its K/V stay behind as prefix cache (if enabled and `keep`).

        `written`: positions it may have written past its K/V (a prefill that failed midway)."""
        i = next((k for k in range(self.n_active) if self.seqs[k] is seq), -1)
        if i < 0:
            return
        last = self.n_active - 1
        self.seqs[i] = None
        self.tokens[i] = seq.kv_tokens if (keep and self.prefix_cache) else []
        self.owner[i] = seq.adapter
        self.last_used[i] = time.monotonic()
        # what the sequence may have written: its K/V and the decode step's row at kv_len (or more)
        self._copied(i, min(self.cache.max_len, max(seq.kv_len + 1, written)))
        other_len = 0
        if i != last:
            other = self.seqs[last]
            other_len = other.kv_len if other is not None else 0
            self._copied(last, min(self.cache.max_len, other_len + 1))  # `other` wrote there so far
            if self.tokens[i]:
                self._swap(i, last, max(len(self.tokens[i]), other_len))
            else:
                self._copy(last, i, other_len)
                self.seqs[i], self.seqs[last] = other, None
            self._trim(i, other_len)
        self._trim(last, len(self.tokens[last]))
        self.n_active -= 1

    def clear_cache(self) -> None:
        """Forget every free slot's K/V (after a weight swap they are stale) and release its memory."""
        for j in range(self.n_active, self.cache.max_batch):
            self.tokens[j] = []
            self._trim(j, 0)

    def trim_cache(self, max_tokens: int) -> int:
        """Evict least recently used prefix-cache slots until they hold at most `max_tokens` tokens (the
        KV budget left by the running sequences); returns the number of tokens evicted."""
        evicted = 0
        cached = self.cached_tokens()
        while cached > max(max_tokens, 0):
            j = min(
                (k for k in range(self.n_active, self.cache.max_batch) if self.tokens[k]),
                key=lambda k: self.last_used[k],
            )
            evicted += len(self.tokens[j])
            cached -= len(self.tokens[j])
            self.tokens[j] = []
            self._trim(j, 0)
        return evicted

    def cached_tokens(self) -> int:
        """Total tokens held as prefix cache."""
        return sum(len(t) for t in self.tokens[self.n_active :])
