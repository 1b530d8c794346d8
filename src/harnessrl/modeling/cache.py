"""A preallocated KV cache with one slot per sequence, shared by all layers."""

from __future__ import annotations

import math
import mmap
import warnings

import torch
from torch import Tensor


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, mmap.mmap | None]:
    """Zeros that cost no resident memory until touched, and (on CPU) the mmap holding them.

    On CPU the memory is an anonymous mmap (the kernel hands out zero pages lazily) advised against
    transparent huge pages: with huge pages (numpy asks for them on large arrays) writing a few
    positions of one slot commits 2 MB pages spanning neighbouring slots, and the cache became resident
    whole (2.9 GB at 64 slots) instead of by the tokens actually held. MAP_NORESERVE: a long-context
    cache (16 slots x 32k tokens is 24 GB for SmolLM2 in fp32) is virtual address space, not a claim
    on memory, so the kernel's overcommit heuristic must not refuse it; the KV budget bounds what is
    written (see `release`).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer" does not apply: the mmap is writable
        return torch.frombuffer(buf, dtype=dtype).view(shape), buf  # the tensor keeps `buf` alive


class KVCache:
    """Keys and values for `max_batch` sequence slots of up to `max_len` tokens.

    Layout: `kv[layer, 0 (keys) | 1 (values), slot, kv_head, position, head_dim]`. A batched decode step
    works on slots `0..B-1` as a view, so the scheduler keeps running sequences packed at the front (see
    `copy`/`swap`). The memory must start finite: a decode step reads (masked) positions past a short
    sequence's end, and a masked NaN still poisons attention (0 * NaN). On CPU it is an anonymous mmap,
    so the OS commits (4 KB) pages only as they are written.
    """

    def __init__(
        self,
        layers: int,
        max_batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_batch, self.max_len = max_batch, max_len
        self._shape = (layers, 2, max_batch, kv_heads, max_len, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self.kv, self._buf = _zeros(self._shape, dtype, self._device)

    @property
    def allocated(self) -> bool:
        """False between `free` and `allocate`."""
        return self.kv.numel() > 0

    def free(self) -> None:
        """Give the cache's memory back (engine sleep); every slot's K/V is lost."""
        self.kv, self._buf = torch.empty(0, dtype=self._dtype, device=self._device), None

    def allocate(self) -> None:
        """Allocate the cache again after `free` (engine wake-up)."""
        if not self.allocated:
            self.kv, self._buf = _zeros(self._shape, self._dtype, self._device)

    def reusable_prefix(self, slot: int, n: int, held: int) -> int:
        """Matching tokens of a slot a new prompt may reuse: all `n` (K/V rows can be cut back anywhere;
        a recurrent state cannot: modeling/hf_cache.py)."""
        return n

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst`."""
        if src != dst and length > 0:
            self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        """Exchange the first `length` positions of slots `a` and `b`."""
        if a != b and length > 0:
            tmp = self.kv[:, :, a, :, :length].clone()
            self.kv[:, :, a, :, :length] = self.kv[:, :, b, :, :length]
            self.kv[:, :, b, :, :length] = tmp

    def release(self, slot: int, start: int, end: int | None = None) -> int:
        """Give the memory of positions start..end of `slot` back to the OS; return the bytes released.

        CPU only (elsewhere a no-op returning 0): whole pages inside the range are dropped
        (MADV_DONTNEED) and read as zeros again, so the cache stays finite. The caller must hold no
        live K/V in the range.
        """
        end = self.max_len if end is None else min(end, self.max_len)
        if self._buf is None or not hasattr(mmap, "MADV_DONTNEED") or start >= end:
            return 0
        layers, _, batch, heads, max_len, head_dim = self._shape
        pos_bytes = head_dim * self.kv.element_size()
        page, released = mmap.PAGESIZE, 0
        for row in range(layers * 2):  # (layer, keys|values)
            for head in range(heads):
                base = ((row * batch + slot) * heads + head) * max_len * pos_bytes
                lo = -(-(base + start * pos_bytes) // page) * page  # whole pages only
                hi = (base + end * pos_bytes) // page * page
                if hi > lo:
                    self._buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    released += hi - lo
        return released

    @property
    def nbytes(self) -> int:
        """Size of the cache tensor in bytes (virtual; pages are committed on first write)."""
        return self.kv.numel() * self.kv.element_size()
