"""Throughput of the builtin engine over HTTP against transformers `generate`, in one run.

`python bench/engine.py --concurrency 1 4 16` prints a table and writes `bench/results/engine.json`:
for each concurrency, aggregate generated tok/s of the engine (`tok_s_harnessrl`), of `generate`
serving one request at a time (`tok_s_hf_naive`), and of `generate` on all prompts padded into one
batch (`tok_s_hf_static`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

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


def _hf_model(engine: Engine) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32).eval()


def _hf_naive(hf: torch.nn.Module, prompt: list[int], max_tokens: int) -> float:
    """tok/s of `generate` on one request (a server doing one at a time has this rate at any load)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)  # type: ignore[operator]
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)  # type: ignore[operator]
    return max_tokens / (time.perf_counter() - t0)


def _hf_static(hf: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> float:
    """tok/s of `generate` on all prompts left-padded into one batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,  # type: ignore[operator]
                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)  # fmt: skip
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print a table, write the JSON results."""
    p = argparse.ArgumentParser(prog="python bench/engine.py")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig(
        model=args.model,
        max_batch=max(args.concurrency),
        max_model_len=1024,
        threads=args.threads,
        dtype=args.dtype,
    )
    engine = Engine(config)
    server = ServerThread(engine).start()
    results: dict[str, dict[str, float]] = {}
    try:
        asyncio.run(_run_level(server.url, _prompts(engine, 1, args.prompt_tokens), 8))  # warm-up
        for c in args.concurrency:
            prompts = _prompts(engine, c, args.prompt_tokens)
            seconds, tokens = asyncio.run(_run_level(server.url, prompts, args.max_tokens))
            results[str(c)] = {"tok_s_harnessrl": tokens / seconds}
    finally:
        server.stop()
    hf = _hf_model(engine)
    naive = _hf_naive(hf, _prompts(engine, 1, args.prompt_tokens)[0], args.max_tokens)
    for c in args.concurrency:
        results[str(c)]["tok_s_hf_naive"] = naive
        results[str(c)]["tok_s_hf_static"] = _hf_static(
            hf, _prompts(engine, c, args.prompt_tokens), args.max_tokens
        )
    print(
        f"{'concurrency':>11}{'harnessrl':>11}{'hf naive':>10}{'hf static':>11}{'vs naive':>10}{'vs static':>11}"
    )
    for c, r in results.items():
        h, n, st = r["tok_s_harnessrl"], r["tok_s_hf_naive"], r["tok_s_hf_static"]
        print(f"{c:>11}{h:>11.1f}{n:>10.1f}{st:>11.1f}{h / n:>10.2f}{h / st:>11.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
    }
    args.out.write_text(json.dumps({"config": meta, "concurrency": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
