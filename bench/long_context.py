"""Long context on CPU: the builtin engine's prefill time for 2k / 8k / 16k-token prompts on SmolLM2 with
its RoPE scaled (`smollm2-16k`, YaRN x2), and what the scaling costs in quality. One run, one machine.

    nice -n 10 python bench/long_context.py          # ~10 min on 2 idle cores

Prefill: the engine in this process behind real loopback HTTP (prefix cache off, `--threads` torch
threads, fp32), a token-ID `/v1/completions` request with max_tokens 1 per prompt; `ttft_s` is the wall
time of that request (time to first token), `prefill_s` the engine's own prefill seconds. Prompts are real
text: the Python reference manual that ships with CPython (`pydoc_data.topics`), cut to the length. The
baseline in the same run is the unscaled `smollm2` at 2k (scaling costs nothing at inference, so the
ratio is ~1; a long prompt costs attention's T^2).

Quality: mean token NLL (and perplexity) of text under the trainer's forward (`hidden_states`, then the
shared logprob definition), lower is better:
- `home`: the first 2,048 tokens of the reference manual's "Special method names" (prose, inside every
  model's trained range) for smollm2, smollm2-16k, smollm2-16k-linear, smollm2-32k;
- `long`: the first `--long-tokens` (8,192) tokens of `argparse.py` (one coherent file of code, where
  later tokens depend on names defined far earlier), for smollm2 and smollm2-16k, by position bucket.
  With `--long-tokens 16384` (about 6 more minutes) smollm2 runs past its 8,192 positions (extrapolation).

Results: bench/results/long_context.json and the table printed at the end.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread
from harnessrl.modeling.loading import load_model, load_tokenizer, resolve_model
from harnessrl.modeling.logprobs import token_logprobs

HOME_MODELS = ["smollm2", "smollm2-16k", "smollm2-16k-linear", "smollm2-32k"]
LONG_MODELS = ["smollm2", "smollm2-16k"]
BUCKETS = [0, 2048, 4096, 8192, 12288, 16384, 32768]


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cpu_seconds() -> float:
    """CPU seconds this process has used (all threads): the work, whatever else shares the cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reference_manual_ids(tokenizer: Any, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of the Python reference manual (pydoc_data.topics, sections in name order)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = list(tokenizer.encode(text).ids)
    if len(ids) < offset + n:
        raise ValueError(f"the reference manual has {len(ids)} tokens, fewer than {offset + n}")
    return ids[offset : offset + n]


def texts(tokenizer: Any, home_tokens: int, long_tokens: int) -> dict[str, list[int]]:
    """The quality texts: `home` (prose, `home_tokens`) and `long` (code, `long_tokens` tokens)."""
    import argparse as argparse_module
    from pydoc_data.topics import topics

    home = list(tokenizer.encode(topics["specialnames"]).ids)[:home_tokens]
    long = list(tokenizer.encode(inspect.getsource(argparse_module)).ids)
    if len(long) < long_tokens:
        raise ValueError(f"argparse.py has {len(long)} tokens, fewer than --long-tokens {long_tokens}")
    return {"home": home, "long": long[:long_tokens]}


def measure_prefill(model: str, lengths: list[int], threads: int, tokenizer: Any) -> list[dict[str, Any]]:
    """Time to first token of one request per prompt length, through the engine over HTTP."""
    torch.set_num_threads(1)  # as the engine's own main(): only the scheduler thread runs a thread team
    config = EngineConfig(model=model, max_batch=1, threads=threads, prefix_cache=False)
    engine = Engine(config)
    server = ServerThread(engine).start()
    rows = []
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            warm = {"prompt": [1, 2, 3, 4], "max_tokens": 1}  # thread pools, first-call allocations
            client.post("/v1/completions", json=warm).raise_for_status()
            for i, n in enumerate(lengths):
                if n + 1 > engine.max_model_len:
                    rows.append({"model": model, "prompt_tokens": n, "skipped": "over max_model_len"})
                    continue
                ids = reference_manual_ids(tokenizer, n, offset=97 * i)  # no two prompts share a prefix
                before = client.get("/admin/stats").json()["prefill_seconds"]
                cpu0, t0 = _cpu_seconds(), time.perf_counter()
                r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0})
                ttft, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
                r.raise_for_status()
                prefill = client.get("/admin/stats").json()["prefill_seconds"] - before
                row = {"model": model, "prompt_tokens": n, "ttft_s": round(ttft, 2),
                       "prefill_s": round(prefill, 2), "prefill_tok_s": round(n / prefill, 1),
                       "cpu_s": round(cpu, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
                print(f"prefill {model:>14} {n:>6} tokens: ttft {ttft:7.1f} s", flush=True)
                rows.append(row)
    finally:
        server.stop()
        engine.shutdown()
    return rows


def nll_by_bucket(model_name: str, ids: list[int], threads: int) -> dict[str, Any]:
    """Mean token NLL of `ids` (each token given all before it), overall and per position bucket."""
    torch.set_num_threads(threads)
    model = load_model(resolve_model(model_name))
    t0 = time.perf_counter()
    x = torch.tensor([ids])
    with torch.inference_mode():
        hidden = model.hidden_states(x)[0]
        nll = torch.cat(
            [
                -token_logprobs(model.logits(hidden[a : a + 1024]), x[0, a + 1 : a + 1025])
                for a in range(0, len(ids) - 1, 1024)
            ]
        )
    seconds = time.perf_counter() - t0
    positions = torch.arange(1, len(ids))  # nll[j] is the token at position j + 1
    buckets = {}
    for lo, hi in itertools.pairwise(BUCKETS):
        sel = (positions >= lo) & (positions < hi)
        if bool(sel.any()):
            buckets[f"{lo}-{hi}"] = round(float(nll[sel].mean()), 4)
    mean = float(nll.mean())
    print(f"nll     {model_name:>18} {len(ids):>6} tokens: {mean:.4f} ({seconds:.0f} s)", flush=True)
    return {"model": model_name, "tokens": len(ids), "nll": round(mean, 4),
            "ppl": round(float(torch.exp(nll.mean())), 3), "nll_by_position": buckets,
            "seconds": round(seconds, 1)}  # fmt: skip


def print_table(result: dict[str, Any]) -> None:
    """The summary table."""
    print("\nprefill (time to first token, one request, prefix cache off)")
    print(
        f"{'model':>14} {'tokens':>7} {'ttft s':>8} {'prefill s':>10} {'tok/s':>7} {'cpu s':>7} {'vs 2k':>7}"
    )
    base = {r["model"]: r for r in result["prefill"] if r.get("prompt_tokens") == 2048}
    for r in result["prefill"]:
        if "ttft_s" not in r:
            continue
        ref = base.get("smollm2-16k") or base.get(r["model"])
        per_tok = (r["prefill_s"] / r["prompt_tokens"]) / (ref["prefill_s"] / 2048) if ref else float("nan")
        print(f"{r['model']:>14} {r['prompt_tokens']:>7} {r['ttft_s']:>8.1f} {r['prefill_s']:>10.1f} "
              f"{r['prefill_tok_s']:>7.0f} {r['cpu_s']:>7.0f} {per_tok:>6.2f}x")  # fmt: skip
    print("  (cpu s: CPU seconds of all threads, the work whatever else ran on the machine; vs 2k: prefill")
    print("   seconds per token relative to smollm2-16k at 2,048 tokens)")
    for name, rows in result["quality"].items():
        print(f"\nquality: {name} ({rows[0]['tokens']} tokens), mean NLL (ppl); by position")
        for r in rows:
            buckets = "  ".join(f"{k}: {v:.3f}" for k, v in r["nll_by_position"].items())
            print(f"{r['model']:>18} {r['nll']:.4f} ({r['ppl']:.2f})   {buckets}")


def main() -> None:
    """Run the measurements and write the results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-16k", help="the long-context model timed")
    p.add_argument("--lengths", default="2048,8192,16368", help="prompt lengths in tokens")
    p.add_argument("--baseline-lengths", default="2048", help="lengths timed on the unscaled smollm2")
    p.add_argument("--home-tokens", type=int, default=2048, help="tokens of the short quality text")
    p.add_argument("--long-tokens", type=int, default=8192, help="tokens of the long quality text")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--out", default="bench/results/long_context.json")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    started = time.time()
    result: dict[str, Any] = {
        "command": "nice -n 10 python bench/long_context.py "
        + f"--lengths {args.lengths} --baseline-lengths {args.baseline_lengths} "
        + f"--home-tokens {args.home_tokens} --long-tokens {args.long_tokens} --threads {args.threads}",
        "cpu": _cpu_model(), "threads": args.threads, "torch": torch.__version__,
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()], "prefill": [], "quality": {},
    }  # fmt: skip
    if not args.skip_prefill:
        lengths = [int(v) for v in args.lengths.split(",")]
        result["prefill"] += measure_prefill(args.model, lengths, args.threads, tokenizer)
        baseline = [int(v) for v in args.baseline_lengths.split(",") if v]
        if baseline:
            result["prefill"] += measure_prefill("smollm2", baseline, args.threads, tokenizer)
    text = texts(tokenizer, args.home_tokens, args.long_tokens)
    home_name = f"home_prose_{args.home_tokens}"
    result["quality"][home_name] = [nll_by_bucket(m, text["home"], args.threads) for m in HOME_MODELS]
    long_name = f"long_code_{args.long_tokens}"
    result["quality"][long_name] = [nll_by_bucket(m, text["long"], args.threads) for m in LONG_MODELS]
    result["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["seconds"] = round(time.time() - started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
