"""Throughput of the builtin engine over HTTP: aggregate tok/s at several concurrency levels.

`python -m harnessrl.engine.bench --model smollm2 --concurrency 1 16 --max-tokens 64 --prompt-tokens 100`
prints a table; `--baseline` adds transformers' `generate` one request at a time for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import httpx
import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread


def _prompts(engine: Engine, n: int, length: int) -> list[list[int]]:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "agents",
        "call",
        "tools",
        "and",
        "read",
        "results",
    ]
    out = []
    for i in range(n):
        text = " ".join(words[(i + j) % len(words)] for j in range(length * 2))
        out.append(engine.encode(f"{i}: {text}")[:length])
    return out


async def _run_level(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(i: int, prompt: list[int]) -> int:
            body = {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
            }
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0, sum(counts)


def _hf_baseline(engine: Engine, prompt: list[int], max_tokens: int) -> float:
    """tok/s of transformers' generate on the same weights, one request."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return max_tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table."""
    p = argparse.ArgumentParser(prog="python -m harnessrl.engine.bench")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--baseline", action="store_true", help="also time transformers generate (1 request)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    top = max(args.concurrency)
    config = EngineConfig(
        model=args.model, max_batch=top, max_model_len=1024, threads=args.threads, dtype=args.dtype
    )
    engine = Engine(config)
    server = ServerThread(engine).start()
    try:
        asyncio.run(_run_level(server.url, _prompts(engine, 1, args.prompt_tokens), 8))  # warm-up
        rows = []
        for c in args.concurrency:
            seconds, tokens = asyncio.run(
                _run_level(server.url, _prompts(engine, c, args.prompt_tokens), args.max_tokens)
            )
            rows.append((f"engine x{c}", tokens, seconds, tokens / seconds))
        if args.baseline:
            rate = _hf_baseline(engine, _prompts(engine, 1, args.prompt_tokens)[0], args.max_tokens)
            rows.append(("hf generate x1", args.max_tokens, args.max_tokens / rate, rate))
    finally:
        server.stop()
    base = rows[0][3]
    print(f"{'setup':<16}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'vs x1':>8}")
    for name, tokens, seconds, rate in rows:
        print(f"{name:<16}{tokens:>8}{seconds:>10.2f}{rate:>10.1f}{rate / base:>8.2f}")


if __name__ == "__main__":
    main()
