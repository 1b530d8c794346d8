"""Helpers for text that is still being generated: how much of its tail may still become a marker."""

from __future__ import annotations


def partial_tail(text: str, marker: str, full: bool = False) -> int:
    """Length of the longest tail of `text` that is a prefix of `marker` (the whole marker too if `full`)."""
    longest = len(marker) if full else len(marker) - 1
    for k in range(min(longest, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def opener_hold(text: str, opener: str) -> tuple[int, bool]:
    """Content up to the first `opener` (then blocked), or all but a tail that may become one."""
    at = text.find(opener)
    if at >= 0:
        return at, True
    return len(text) - partial_tail(text, opener), False
