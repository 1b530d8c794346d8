"""The scale path on one GPU, in one command (issue 48): a bf16 update against fp32, the same bf16 update
through FSDP2 (one rank), the flash-attention path of the trainer's forward, packed rows through torch's
varlen flash kernel, and a LoRA weight sync into a live engine against a full one.

    python bench/gpu_scale_check.py --model-dir DIR --out bench/results/gpu/scale_check.json
    python bench/gpu_scale_check.py --tiny --device cpu      # a dry run of the script on CPU (no flash check)
    python bench/gpu_scale_check.py --only packed_rows       # one check (or several) alone

It has not run on a GPU yet (no GPU was lent while it was written); on CPU it runs end to end.

- **bf16 update**: two PPO updates of the same rows with `train.dtype` float32 (AdamW), bfloat16
  (MasterAdamW) and bfloat16 with `train.exp_avg_dtype: bfloat16`, peak GPU memory of each
  (`torch.cuda.max_memory_allocated`) and their ratios to fp32's, the largest |bf16 − fp32| trainer logprob
  before the update, and the largest differences of the fp32 master weights after it (bf16 vs fp32; the
  bf16 first moment vs the exact one).
- **bf16 fsdp update**: the trainer's FSDP2 path (`trainer/fsdp.py`: fp32 shards, bf16 compute through
  `MixedPrecisionPolicy`, fp32 gradient reduction) on a one-rank process group (NCCL on a GPU, gloo on
  CPU; one GPU cannot hold two NCCL ranks): two updates of the same rows against the one-process bf16
  update (`MasterAdamW`) from the same bf16 start: the largest difference of the two schedules' steps
  (after − before), the fp32 step for scale, and the peak GPU memory of each.
- **flash path**: the trainer's forward (shared prefix: the suffix attends through a lower-right causal
  bias, no mask matrix) in bf16 with SDPA restricted to the flash and memory-efficient kernels: it must
  run (a mask would make SDPA refuse) and agree with the math kernel (rows padded: `pack="off"`).
- **packed rows** (`train.pack_rows`, trainer/packing.py): one forward + backward of rows of 300, 800 and
  2,000 tokens after a 64-token shared prefix, padded and packed, in bf16 (on CUDA the packed rows attend
  through `torch.nn.attention.varlen.varlen_attn`, one call per layer: `varlen_calls` counts them) and in
  fp32 (one SDPA call per row): seconds of each (after a warm-up of both), their ratio, and the logprob
  and gradient differences against the padded forward on SDPA's math kernel.
- **LoRA sync**: a builtin engine on the GPU gets an adapter (`publish_weights` with `lora`) and the full
  model by file and from memory (`engine.weight_sync`), 3 times each: median seconds, bytes of the sync,
  and the engine-vs-trainer logprob gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def check_bf16_update(model_dir: Path, device: str, rows: int) -> dict[str, Any]:
    """fp32 vs bf16 (fp32 AdamW moments) vs bf16 with a bf16 first moment (`train.exp_avg_dtype`): peak
    memory of two updates, logprob and master-weight differences."""
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.forward import selected_logprobs
    from harnessrl.trainer.ppo import PPOConfig, _pack, ppo_update
    from harnessrl.trainer.precision import make_optimizer, master_weights

    batch, cfg = demo_batch(1, rows), PPOConfig()
    out: dict[str, Any] = {}
    lps, weights = {}, {}
    arms = (("fp32", torch.float32, "float32"), ("bf16", torch.bfloat16, "float32"),
            ("bf16_exp_avg_bf16", torch.bfloat16, "bfloat16"))  # fmt: skip
    for name, dtype, exp_avg_dtype in arms:
        _peak_reset(device)
        model = load_model(model_dir, dtype=dtype, device=device)
        p = _pack(batch, list(range(len(batch.rows))), torch.device(device))
        with torch.no_grad():
            lps[name] = selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix).logprobs.float().cpu()
        opt = make_optimizer(
            model.parameters(), dtype, lr=1e-5, weight_decay=0.0, exp_avg_dtype=exp_avg_dtype
        )
        t0 = time.perf_counter()
        for _ in range(2):
            ppo_update(model, opt, batch, cfg)
        out[f"{name}_seconds"] = round(time.perf_counter() - t0, 2)
        out[f"{name}_peak_mb"] = _peak_mb(device)
        weights[name] = {n: master_weights(opt, q).cpu() for n, q in model.named_parameters()}
        del model, opt
    if out["fp32_peak_mb"]:
        out["update_peak_mb_ratio_vs_fp32"] = round(out["bf16_peak_mb"] / out["fp32_peak_mb"], 3)
        out["exp_avg_bf16_update_peak_mb_ratio_vs_fp32"] = round(
            out["bf16_exp_avg_bf16_peak_mb"] / out["fp32_peak_mb"], 3
        )
    out["logprob_max_diff_vs_fp32"] = float((lps["fp32"] - lps["bf16"]).abs().max())
    out["master_weight_max_diff_vs_fp32"] = max(
        float((weights["fp32"][n] - w).abs().max()) for n, w in weights["bf16"].items()
    )
    # the bf16 first moment against the exact one, same bf16 start and gradients: the update's own error
    out["exp_avg_bf16_master_weight_max_diff_vs_bf16"] = max(
        float((weights["bf16"][n] - w).abs().max()) for n, w in weights["bf16_exp_avg_bf16"].items()
    )
    return out


def check_fsdp_bf16(model_dir: Path, device: str, rows: int, updates: int = 2) -> dict[str, Any]:
    """bf16 through FSDP2 on one rank vs the one-process bf16 update: steps, peak memory (docstring)."""
    import socket

    import torch.distributed as dist
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.distributed import rank_update
    from harnessrl.trainer.fsdp import gather_full, shard
    from harnessrl.trainer.ppo import PPOConfig, ppo_update
    from harnessrl.trainer.precision import make_optimizer, master_weights

    batch, cfg = demo_batch(1, rows), PPOConfig()
    out: dict[str, Any] = {"updates": updates}
    _peak_reset(device)
    one = load_model(model_dir, dtype=torch.bfloat16, device=device)
    start1 = {n: p.detach().float().cpu() for n, p in one.named_parameters()}
    opt1 = make_optimizer(one.parameters(), torch.bfloat16, lr=1e-5, weight_decay=0.0)
    for _ in range(updates):
        ppo_update(one, opt1, batch, cfg)
    out["one_process_peak_mb"] = _peak_mb(device)
    step1 = {n: master_weights(opt1, p).cpu() - start1[n] for n, p in one.named_parameters()}
    del one, opt1
    with socket.socket() as s:  # a free loopback port for the one-rank group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _peak_reset(device)
        # the fp32 shards start from the same bf16 numbers as the one process's master weights
        model = load_model(model_dir, dtype=torch.bfloat16, device=device).float()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        root = shard(model, opt, torch.bfloat16, torch.device(device))
        t0 = time.perf_counter()
        for _ in range(updates):
            rank_update(root, opt, batch, cfg)
        out["fsdp_seconds"] = round(time.perf_counter() - t0, 2)
        out["fsdp_peak_mb"] = _peak_mb(device)
        weights, _ = gather_full(model, opt, with_optimizer=False)
        assert weights is not None  # rank 0 of 1
    finally:
        dist.destroy_process_group()
    common = [n for n in step1 if n in weights]  # a tied lm_head is gathered once, as the embedding
    out["tensors_compared"] = f"{len(common)} of {len(step1)}"
    out["fsdp_vs_one_process_max_step_diff"] = max(
        float((weights[n].float() - start1[n] - step1[n]).abs().max()) for n in common
    )
    out["one_process_max_step"] = max(float(d.abs().max()) for d in step1.values())
    return out


def check_flash(model_dir: Path, device: str, rows: int) -> dict[str, Any]:
    """The trainer's shared-prefix forward in bf16 on the flash/memory-efficient kernels vs math."""
    from bench.scale import demo_batch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.forward import selected_logprobs
    from harnessrl.trainer.ppo import _pack

    if not device.startswith("cuda"):
        return {"skipped": "flash and memory-efficient SDPA kernels are GPU kernels"}
    model = load_model(model_dir, dtype=torch.bfloat16, device=device)
    batch = demo_batch(1, rows)
    p = _pack(batch, list(range(len(batch.rows))), torch.device(device))
    result: dict[str, Any] = {"prefix": p.prefix}
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):
            ref = selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix, pack="off").logprobs.float()
        for name, backend in (
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ):
            try:
                with sdpa_kernel([backend]):
                    lp = selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix, pack="off")
                    lp = lp.logprobs.float()
                result[f"{name}_max_diff_vs_math"] = float((lp - ref).abs().max())
            except RuntimeError as e:
                result[f"{name}_error"] = str(e)[:300]
    return result


def check_packed(model_dir: Path, device: str, lengths: tuple[int, ...] = (300, 800, 2000)) -> dict[str, Any]:
    """Packed rows against padded ones, bf16 and fp32: differences and seconds of a forward + backward."""
    from bench.packed_rows import micro_batch, step
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.packing import RowAttention

    prefix, out = 64, {"lengths": list(lengths), "prefix": 64}
    varlen_calls: list[int] = []
    original = RowAttention._varlen

    def counted(self: RowAttention, *args: Any) -> Any:
        varlen_calls.append(len(self.lengths))
        return original(self, *args)

    RowAttention._varlen = counted  # type: ignore[method-assign]
    try:
        for dtype in (torch.bfloat16, torch.float32):
            model = load_model(model_dir, dtype=dtype, device=device)
            model.train()
            batch = tuple(t.to(device) for t in micro_batch(model.config.vocab_size, list(lengths), prefix))
            with sdpa_kernel([SDPBackend.MATH]):
                _, lp_ref, grads = step(model, batch, prefix, "off")
                g_ref = {n: g.float().clone() for n, g in grads.items()}
            step(model, batch, prefix, "off")  # warm-up of the default kernels, then of the packed path
            step(model, batch, prefix, "on")
            padded_s, lp_pad, _ = step(model, batch, prefix, "off")
            del varlen_calls[:]
            packed_s, lp, grads = step(model, batch, prefix, "on")
            rel = max(float((grads[n].float() - g).abs().max() / g.abs().max()) for n, g in g_ref.items()
                      if g.abs().max() > 0)  # fmt: skip
            out[str(dtype).removeprefix("torch.")] = {
                "varlen_calls": len(varlen_calls), "padded_s": round(padded_s, 4), "packed_s": round(packed_s, 4),
                "speedup": round(padded_s / packed_s, 2),
                "padded_max_diff_vs_math": float((lp_pad.float() - lp_ref.float()).abs().max()),
                "packed_max_diff_vs_math": float((lp.float() - lp_ref.float()).abs().max()),
                "packed_grad_max_rel_diff_vs_math": rel,
            }  # fmt: skip
            del model, grads, g_ref
    finally:
        RowAttention._varlen = original  # type: ignore[method-assign]
    return out


def check_lora_sync(model_dir: Path, device: str, syncs: int = 3) -> dict[str, Any]:
    """Adapter vs full-model syncs into a live engine on `device`: seconds, bytes, logprob gap."""
    from harnessrl.engine.config import EngineConfig
    from harnessrl.engine.core import Engine
    from harnessrl.engine.server import ServerThread
    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.lora import LoraSpec, attach
    from harnessrl.modeling.weight_stream import WeightStream, sync_state
    from harnessrl.trainer.weights import EngineAdmin, publish_weights

    engine = Engine(EngineConfig(model=str(model_dir), max_batch=2, max_model_len=512, device=device))
    server = ServerThread(engine).start()
    model = load_model(model_dir, device=device)
    adapter = attach(model, LoraSpec(r=8), seed=1, base_model=str(model_dir))
    with torch.no_grad():
        for b in adapter.lora_B:
            b.normal_(0, 0.02)
    out: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k, mode in enumerate(("lora", "full", "memory")):  # full: by file; memory: the default

                async def publish(
                    version: int, lora: Any, folder: Path = Path(tmp) / mode, how: str = mode
                ) -> float:
                    admin = EngineAdmin(server.url, weight_sync="memory" if how == "memory" else "file")
                    try:
                        return await publish_weights(model, admin, folder, version, lora)
                    finally:
                        await admin.aclose()

                base = 1 + k * syncs
                walls = [
                    asyncio.run(publish(base + i, adapter if mode == "lora" else None)) for i in range(syncs)
                ]
                last = Path(tmp) / mode / f"v{base + syncs - 1}"
                sent = len(WeightStream(sync_state(model))) if mode == "memory" else None
                out[mode] = {"seconds": round(statistics.median(walls), 3),
                             "bytes": sent or sum(f.stat().st_size for f in last.iterdir())}  # fmt: skip
    finally:
        server.stop()
    out["lora_vs_full_seconds"] = round(out["lora"]["seconds"] / out["full"]["seconds"], 3)
    out["memory_vs_file_seconds"] = round(out["memory"]["seconds"] / out["full"]["seconds"], 3)
    return out


def main() -> int:
    """Run the five checks (or `--only` some); print and write them as JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (a dry run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--only", nargs="+", help="run these checks only (bf16_update, fsdp_bf16_update, flash, "
                   "packed_rows, lora_sync)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu" / "scale_check.json")
    args = p.parse_args()
    if args.tiny:
        from harnessrl.modeling.loading import make_tiny_model_dir

        args.model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny")
    elif args.model_dir is None:
        from harnessrl.modeling.loading import resolve_model

        args.model_dir = resolve_model("smollm2")
    res: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "model_dir": str(args.model_dir),
                           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}  # fmt: skip
    checks = (("bf16_update", lambda: check_bf16_update(args.model_dir, args.device, args.rows)),
                        ("fsdp_bf16_update", lambda: check_fsdp_bf16(args.model_dir, args.device, args.rows)),
                        ("flash", lambda: check_flash(args.model_dir, args.device, args.rows)),
                        ("packed_rows", lambda: check_packed(args.model_dir, args.device)),
                        ("lora_sync", lambda: check_lora_sync(args.model_dir, args.device)))  # fmt: skip
    for name, check in checks:
        if args.only and name not in args.only:
            continue
        try:
            res[name] = check()
        except Exception as e:  # every check runs; a failure is reported, not fatal
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(name, json.dumps(res[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 1 if any("error" in v for v in res.values() if isinstance(v, dict)) else 0


if __name__ == "__main__":
    sys.exit(main())
