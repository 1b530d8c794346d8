"""Giving freed memory back to the OS, shared by the engine (after loads) and the trainer (after updates)."""

from __future__ import annotations

import ctypes
import gc
import sys


def trim_heap() -> None:
    """Return the free pages of glibc's heap to the OS (`malloc_trim`), without a garbage collection:
    cheap enough between the passes of a training update, whose freed activations would otherwise stay
    resident and fragment the heap under the gradients allocated next."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def release_freed_memory() -> None:
    """Collect garbage, then return freed heap memory to the OS: glibc keeps freed blocks below its
    (adaptive, up to 32 MB) mmap threshold in its arenas, which inflates the resident size otherwise."""
    gc.collect()
    trim_heap()
