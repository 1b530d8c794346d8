"""Prompt rendering cost of each family's own chat template against harnessrl's ChatML convention (the
baseline, SmolLM2's path), in the same run: a tool conversation of N messages rendered whole (what the
engine does per chat call; the gateway's tito mode renders it twice: the whole and the covered turns).

    PYTHONPATH=src python bench/chat_render.py --turns 10 --repeat 200

Needs the real tokenizers in .cache/tokenizers (`make install`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.conversations import FAMILIES, TOOL_CONVERSATION, TOOLS, tokenizer_dir

from harnessrl.chat import ChatFormat, render_chat


def per_call_ms(fn: Callable[[], object], repeat: int) -> float:
    """Mean milliseconds of `fn` over `repeat` calls (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    """Print a table: format, ms per render, ratio to the ChatML baseline."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=10, help="tool round trips in the conversation")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    messages = [TOOL_CONVERSATION[0], *TOOL_CONVERSATION[1:5] * args.turns, TOOL_CONVERSATION[5]]
    base = per_call_ms(lambda: render_chat(messages, TOOLS), args.repeat)
    print(f"{len(messages)} messages, {args.repeat} renders each")
    print(f"{'format':10s} {'ms/render':>10s} {'x chatml':>9s}")
    print(f"{'chatml':10s} {base:10.3f} {1.0:9.1f}")
    for family in FAMILIES:
        fmt = ChatFormat.from_folder(tokenizer_dir(family))
        ms = per_call_ms(lambda fmt=fmt: fmt.render(messages, TOOLS, date_string="26 Jul 2024"), args.repeat)
        print(f"{family:10s} {ms:10.3f} {ms / base:9.1f}")


if __name__ == "__main__":
    main()
