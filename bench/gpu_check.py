"""Checks of the builtin engine on a GPU: exact logprobs per dtype, and what engine sleep gives back.

Run by `bench/gpu_check.sh` on a machine with a CUDA GPU (it also runs on CPU, with less to show):

    python bench/gpu_check.py --model-dir DIR --device cuda --out bench/results/gpu_check.json

- **exactness**: 8 concurrent requests of 64 sampled tokens (temperature 1) through the engine's HTTP
  server; the trainer's forward pass (same dtype, same device) recomputes each token's logprob; the
  max and mean gap are reported per dtype (fp32 must stay under 1e-4).
- **sleep**: GPU memory allocated by the engine (it runs in this process) awake, asleep at level 1,
  awake again, asleep at level 2, after wake-up, and after the weight load that level 2 needs; the
  same request answered before and after must produce the same tokens and logprobs.

`--make-model CONFIG_DIR` first writes a model with that config.json and tokenizer and random weights
(embeddings scaled so logits spread like a trained model's: near-uniform logits would hide an inexact
kernel), for machines where the real SmolLM2 weights cannot be brought.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import TOKENIZER_FILES, load_model, read_model_config, save_model
from harnessrl.modeling.logprobs import next_token_logprobs


def make_model(config_dir: Path, out: Path, seed: int = 0) -> Path:
    """A model with `config_dir`'s config and tokenizer and random weights (see the module doc): the
    tied embeddings are scaled by 144/sqrt(hidden) (6 for SmolLM2: logits neither near-uniform nor one-hot)."""
    cfg = read_model_config(config_dir)
    model = LlamaForCausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(144 / cfg.hidden_size**0.5)
    save_model(model, out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(config_dir / name, out / name)
    return out


def _post_all(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
            for r in rs:
                r.raise_for_status()
            return [r.json() for r in rs]

    return asyncio.run(go())


def check_exactness(model_dir: Path, device: str, dtype: str, n: int = 8, tokens: int = 64) -> dict[str, Any]:
    """Engine logprobs of sampled tokens against the trainer's forward pass, same dtype and device."""
    engine = Engine(EngineConfig(model=str(model_dir), max_batch=n, max_model_len=512, dtype=dtype,
                                 device=device))  # fmt: skip
    server = ServerThread(engine).start()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (20 + 7 * i,), generator=gen).tolist() for i in range(n)]
    bodies = [{"prompt": p, "max_tokens": tokens, "temperature": 1.0, "seed": i, "logprobs": 1,
               "ignore_eos": True} for i, p in enumerate(prompts)]  # fmt: skip
    try:
        results = _post_all(server.url, bodies)
    finally:
        server.stop()
    del engine, server
    trainer = load_model(model_dir, dtype=getattr(torch, dtype), device=device)
    gaps: list[float] = []
    entropies: list[float] = []
    for prompt, res in zip(prompts, results, strict=True):
        choice = res["choices"][0]
        reported = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
        ids = torch.tensor([prompt + choice["token_ids"]], device=device)
        with torch.no_grad():
            logits = trainer(ids)
            lp = next_token_logprobs(logits, ids, 1.0)[0, len(prompt) - 1 :].double().cpu()
            probs = torch.softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
            entropies.append(float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()))
        gaps += (reported - lp).abs().tolist()
    del trainer
    _free(device)
    return {"dtype": dtype, "tokens": len(gaps), "max_abs_gap": max(gaps), "mean_abs_gap": sum(gaps) / len(gaps),
            "mean_entropy_nats": sum(entropies) / len(entropies)}  # fmt: skip


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _allocated_mb(device: str) -> float | None:
    return torch.cuda.memory_allocated() / 2**20 if device.startswith("cuda") else None


def check_sleep(
    model_dir: Path, device: str, max_batch: int = 64, max_model_len: int = 1024
) -> dict[str, Any]:
    """Memory held by the engine through sleep levels 1 and 2, and identical answers after."""
    _free(device)
    base = _allocated_mb(device)
    engine = Engine(EngineConfig(model=str(model_dir), max_batch=max_batch, max_model_len=max_model_len,
                                 device=device))  # fmt: skip
    server = ServerThread(engine).start()
    body = {
        "prompt": list(range(100, 160)),
        "max_tokens": 32,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    c = httpx.Client(base_url=server.url, timeout=600)
    mem: dict[str, float | None] = {}
    timings: dict[str, float] = {}

    def step(name: str, method: str, path: str, **kw: Any) -> httpx.Response:
        t0 = time.perf_counter()
        r = c.request(method, path, **kw)
        r.raise_for_status()
        timings[name] = time.perf_counter() - t0
        mem[name] = None if base is None else (_allocated_mb(device) or 0.0) - base
        return r

    try:
        before = step("awake", "POST", "/v1/completions", json=body).json()["choices"][0]
        step("sleep_level_1", "POST", "/admin/sleep", params={"level": 1})
        step("wake_from_1", "POST", "/admin/wake_up")
        again = step("served_after_1", "POST", "/v1/completions", json=body).json()["choices"][0]
        step("sleep_level_2", "POST", "/admin/sleep", params={"level": 2})
        step("wake_from_2", "POST", "/admin/wake_up")
        step("weights_loaded", "POST", "/admin/load_weights", json={"path": str(model_dir), "version": 1})
        after = step("served_after_2", "POST", "/v1/completions", json=body).json()["choices"][0]
        stats = c.get("/admin/stats").json()
    finally:
        c.close()
        server.stop()
    same = all(
        x["token_ids"] == before["token_ids"] and x["logprobs"] == before["logprobs"] for x in (again, after)
    )
    return {"allocated_mb": mem, "seconds": timings, "same_answers": same, "kv_cache_mb": stats["kv_cache_bytes"] / 2**20,
            "weight_mb": stats["weight_bytes"] / 2**20}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run the checks, print them, write JSON."""
    p = argparse.ArgumentParser(prog="python bench/gpu_check.py")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument(
        "--make-model", type=Path, default=None, help="config + tokenizer dir: write random weights"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json")
    args = p.parse_args(argv)
    if args.make_model:
        make_model(args.make_model, args.model_dir)
    if not args.dtypes:  # --dtypes with none: only write the model
        return
    out: dict[str, Any] = {"device": args.device, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}  # fmt: skip
    out["exactness"] = []
    for dtype in args.dtypes:
        res = check_exactness(args.model_dir, args.device, dtype)
        print(f"exactness {dtype}: max |engine - trainer| {res['max_abs_gap']:.2e}, mean {res['mean_abs_gap']:.2e} "
              f"over {res['tokens']} tokens (mean entropy {res['mean_entropy_nats']:.2f} nats)", flush=True)  # fmt: skip
        out["exactness"].append(res)
    out["sleep"] = check_sleep(args.model_dir, args.device)
    print("sleep:", json.dumps(out["sleep"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
