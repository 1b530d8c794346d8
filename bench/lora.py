"""LoRA vs full fine-tuning, measured in the same run (each phase in a fresh process, so peaks are its own).

Phases:
- update (SmolLM2-135M-Instruct, fp32, as the demo's trainer: oneDNN matmuls when the probe accepts
  them, AdamW): `--rows` rows shaped like the calc example's (bench/memory_update.py), `--updates` PPO
  updates; update seconds, trainer peak RSS (VmHWM) during the updates, trainable parameters and
  optimizer-state MB — full fine-tuning vs `train.lora` (r 8, every linear projection);
- sync (bench/sync_phase.py): a live builtin engine process on SmolLM2 gets new weights through
  `publish_weights` (what the run does after every update): bytes moved, seconds, CPU seconds, engine and
  trainer peak RSS above their RSS before, and the engine-vs-trainer logprob gap on 4 x 48 sampled tokens
  — the full model by file (`engine.weight_sync: file`) and from memory (`memory`, the default), each
  from an fp32 and a bf16 trainer, and an adapter with random (trained-like) B;
- decode: serving an adapter merged into the packed weights, unmerged on them (what the engine does
  after a LoRA sync: `PackedLinears.set_lora`), merged over F.linear, and applied per request (forward
  hooks over F.linear): ms per batched decode step;
- big: one LoRA update of a Qwen2.5-1.5B-shaped Llama (random weights, bf16 base, fp32 adapters) with
  its peak RSS; full fine-tuning of it is not attempted (its AdamW state alone would not fit), its
  memory is estimated from the parameter count.

    python bench/lora.py [--rows 2] [--updates 1] [--big-tokens 128] [--skip-big] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MB = 1024 * 1024
LORA = {"r": 8, "alpha": 16.0}


def _kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass


def _batch(rows: int) -> Any:
    """The first `rows` rows of bench/memory_update.py's demo-shaped batch (one group's prefix)."""
    from harnessrl.adapter import Batch, LossMode, loss_weights

    sys.path.insert(0, str(Path(__file__).parent))
    from memory_update import demo_like_batch

    full = demo_like_batch()
    kept = full.rows[:rows]
    return Batch(kept, full.advantages[:rows], loss_weights(kept, LossMode.ROLLOUT_TOKEN_MEAN), {})


def _attach(model: Any, seed: int = 0, random_b: bool = False) -> Any:
    import torch

    from harnessrl.modeling.lora import LoraSpec, attach

    adapter = attach(model, LoraSpec(**LORA), seed=seed, base_model="smollm2")  # type: ignore[arg-type]
    if random_b:  # a trained-like adapter (a fresh one has B = 0 and changes nothing)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for b in adapter.lora_B:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return adapter


def _state_mb(optimizer: Any) -> float:
    return round(
        sum(v.nbytes for s in optimizer.state.values() for v in s.values() if hasattr(v, "nbytes")) / MB, 1
    )


def phase_update(mode: str, rows: int, updates: int) -> dict[str, Any]:
    """PPO updates of SmolLM2 (full or LoRA): seconds and peak RSS."""
    import torch

    from harnessrl.modeling.loading import load_model, resolve_model
    from harnessrl.modeling.packed import use_onednn_for_training

    model = load_model(resolve_model("smollm2"))
    matmul = use_onednn_for_training(model, "auto", torch.device("cpu"))
    trained = list(model.parameters()) if mode == "full" else list(_attach(model).parameters())
    return _updates(model, trained, _batch(rows), updates, {"matmul": matmul})


def _updates(model: Any, trained: list[Any], batch: Any, updates: int, out: dict[str, Any]) -> dict[str, Any]:
    import torch

    from harnessrl.trainer.ppo import PPOConfig, ppo_update

    opt = torch.optim.AdamW(trained, lr=1e-4)
    out.update(trainable_params=sum(p.numel() for p in trained), rss_loaded_mb=round(_kb("VmRSS") / 1024),
               rows=len(batch.rows), tokens=sum(len(r.tokens) for r in batch.rows), updates=[])  # fmt: skip
    for _ in range(updates):
        _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        m = ppo_update(model, opt, batch, PPOConfig(micro_batch_tokens=4096))
        out["updates"].append({"seconds": round(time.perf_counter() - t0, 2), "cpu_seconds": round(time.process_time() - c0, 2),
                               "rss_peak_mb": round(_kb("VmHWM") / 1024), "grad_norm": round(m["grad_norm"], 4)})  # fmt: skip
    out["optimizer_state_mb"] = _state_mb(opt)
    return out


def phase_decode(steps: int = 8, batch: int = 4) -> dict[str, Any]:
    """ms per decode step: adapter merged (packed oneDNN and F.linear) vs applied per request (hooks)."""
    import torch

    from harnessrl.modeling.loading import load_model, load_weights_into, resolve_model
    from harnessrl.modeling.lora import merged_state
    from harnessrl.modeling.lora_swap import adapter_terms
    from harnessrl.modeling.packed import choose_matmul

    out: dict[str, Any] = {"batch": batch, "steps": steps}
    for variant in ("merged_onednn", "unmerged_onednn", "merged_aten", "per_request_hooks"):
        model = load_model(resolve_model("smollm2"))
        adapter = _attach(model, seed=2, random_b=True)
        if variant.startswith("merged"):
            state = merged_state(model, adapter)
            adapter.detach_hooks()
            load_weights_into(model, state)
        if variant.endswith("onednn"):
            packed, out["onednn"] = choose_matmul(model, "onednn", torch.device("cpu"))
        if variant == "unmerged_onednn":  # what the engine serves after a LoRA sync (PackedLinears.set_lora)
            adapter.detach_hooks()
            assert packed is not None
            packed.release_originals()
            terms = adapter_terms((adapter.spec, adapter.peft_tensors()))
            packed.set_lora({n: t for n, t in terms.items() if n in packed.lora_names()})
        out[variant + "_ms"] = round(_decode_ms(model, steps, batch), 2)
        del model, adapter
    out["per_request_over_merged_aten"] = round(out["per_request_hooks_ms"] / out["merged_aten_ms"], 3)
    out["unmerged_over_merged_onednn"] = round(out["unmerged_onednn_ms"] / out["merged_onednn_ms"], 3)
    return out


def _decode_ms(model: Any, steps: int, batch: int) -> float:
    import torch

    cache = model.new_cache(batch, 256)
    with torch.inference_mode():
        model.prefill_many([(torch.arange(16) + 100 * i, i, 0) for i in range(batch)], cache)
        tokens, lengths = torch.full((batch,), 300), torch.full((batch,), 16)
        model.decode(tokens, cache, lengths)  # warm-up
        t0 = time.perf_counter()
        for k in range(steps):
            model.decode(tokens, cache, lengths + 1 + k)
        return (time.perf_counter() - t0) / steps * 1000


def qwen15b_config() -> Any:
    """Qwen2.5-1.5B's shape as a Llama (no q/k/v bias): 28 layers, hidden 1536, GQA 12/2, vocab 151,936."""
    from harnessrl.modeling.llama import LlamaConfig

    return LlamaConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True)  # fmt: skip


def phase_big(tokens: int) -> dict[str, Any]:
    """One LoRA update of the Qwen2.5-1.5B-shaped model, bf16 base with random weights."""
    import torch

    from harnessrl.adapter import Batch, LossMode, Row, loss_weights
    from harnessrl.modeling.llama import LlamaForCausalLM

    cfg = qwen15b_config()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    init_s = time.perf_counter() - t0
    half = tokens // 2
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(3, 150000, (tokens,), generator=g).tolist()
    mask = [0] * half + [1] * (tokens - half)
    rows = [Row("r0", toks, mask, [-1.0 * m for m in mask], temperature=1.0)]
    batch = Batch(rows, [1.0], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})
    adapter = _attach(model)
    out = _updates(model, list(adapter.parameters()), batch, 1, {"init_seconds": round(init_s, 1)})
    out["base_params"] = n_params
    out["base_weights_mb"] = round(n_params * 2 / MB)
    # full fine-tuning of it: fp32 master weights + AdamW's two fp32 moments + fp32 gradients
    out["full_ft_estimate_gb"] = {"adamw_state_and_master_fp32": round(n_params * 12 / 2**30, 1),
                                  "with_fp32_grads_and_bf16_weights": round(n_params * 18 / 2**30, 1)}  # fmt: skip
    return out


def _child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--phase", *args], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"phase {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _phase(argv: list[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(
        int(os.environ.get("BENCH_THREADS", "1"))
    )  # a shared machine: no spin-waiting teams
    name, *rest = argv
    if name == "update":
        return phase_update(rest[0], int(rest[1]), int(rest[2]))
    if name == "sync":
        from sync_phase import phase_sync

        return phase_sync(rest[0], _attach)
    if name == "decode":
        return phase_decode()
    if name == "big":
        return phase_big(int(rest[0]))
    raise SystemExit(f"unknown phase {name}")


def table(res: dict[str, Any]) -> str:
    """The comparison as a text table (LoRA / full ratios in the last column)."""
    f, lo = res["update"]["full"], res["update"]["lora"]
    sf, sl = res["sync"]["full"], res["sync"]["lora"]
    last = lambda r: r["updates"][-1]  # noqa: E731
    lines = [f"{'SmolLM2-135M':36} {'full':>12} {'lora r8':>12} {'lora/full':>10}"]
    for label, a, b in (
        ("trainable params", f["trainable_params"], lo["trainable_params"]),
        ("optimizer state MB", f["optimizer_state_mb"], lo["optimizer_state_mb"]),
        ("update seconds (last)", last(f)["seconds"], last(lo)["seconds"]),
        ("update CPU seconds (last)", last(f)["cpu_seconds"], last(lo)["cpu_seconds"]),
        ("trainer peak RSS MB", max(u["rss_peak_mb"] for u in f["updates"]), max(u["rss_peak_mb"] for u in lo["updates"])),
        ("weight sync bytes", sf["bytes"], sl["bytes"]),
        ("weight sync seconds (median)", sf["seconds"], sl["seconds"]),
        ("weight sync CPU seconds (median)", sf["cpu_seconds"], sl["cpu_seconds"]),
    ):  # fmt: skip
        lines.append(f"{label:36} {a:>12.4g} {b:>12.4g} {b / a if a else float('nan'):>10.3f}")
    lines.append(sync_table(res["sync"]))
    d = res["decode"]
    lines.append(f"decode ms/step (batch {d['batch']}): merged onednn {d['merged_onednn_ms']}, unmerged onednn "
                 f"{d.get('unmerged_onednn_ms')}, merged aten {d['merged_aten_ms']}, per-request hooks "
                 f"{d['per_request_hooks_ms']}")  # fmt: skip
    if "big" in res:
        b = res["big"]
        lines.append(f"Qwen2.5-1.5B-shaped bf16, LoRA r8, {b['tokens']} tokens: update {b['updates'][0]['seconds']} s, "
                     f"peak RSS {b['updates'][0]['rss_peak_mb']} MB; full FT estimate {b['full_ft_estimate_gb']}")  # fmt: skip
    return "\n".join(lines)


def sync_table(sync: dict[str, Any]) -> str:
    """Every way of syncing side by side ("full" is the file sync; shm the default for the builtin engine)."""
    ways = ("full", "shm", "socket", "file_bf16", "shm_bf16", "socket_bf16", "lora")
    rows = [("bytes moved", "bytes", "{:.4g}"), ("seconds (median)", "seconds", "{:.3g}"),
            ("CPU seconds, trainer + engine", "cpu_seconds", "{:.3g}"),
            ("engine peak RSS above before, MB", "engine_peak_extra_mb", "{:.0f}"),
            ("  of it the engine's own heap, MB", "engine_anon_peak_extra_mb", "{:.0f}"),
            ("  shared memory it maps, MB", "engine_shmem_peak_mb", "{:.0f}"),
            ("trainer peak RSS above before, MB", "trainer_peak_extra_mb", "{:.0f}"),
            ("files written", "files_written", "{}")]  # fmt: skip
    lines = [f"{'weight sync, SmolLM2 -> fp32 engine':36}" + "".join(f"{m:>12}" for m in ways)]
    for label, key, fmt in rows:
        lines.append(f"{label:36}" + "".join(f"{fmt.format(sync[m][key]):>12}" for m in ways))
    lines.append(f"memory / file seconds: shm {sync['shm_vs_file_seconds']} (bf16 {sync['shm_vs_file_seconds_bf16']}), "
                 f"socket {sync['socket_vs_file_seconds']} (bf16 {sync['socket_vs_file_seconds_bf16']})")  # fmt: skip
    return "\n".join(lines)


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent)  # fmt: skip
    return proc.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--phase":
        sys.stdout.write(json.dumps(_phase(argv[1:])) + "\n")
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--big-tokens", type=int, default=128)
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--phases", nargs="+", choices=["update", "sync", "decode", "big"],
                   default=["update", "sync", "decode", "big"],
                   help="run these phases only; the others' results are kept from --out")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lora.json")
    args = p.parse_args(argv)
    t0 = time.time()
    res: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    res.update(lora=LORA, commit=_commit())
    for mode in ("full", "lora"):
        if "update" in args.phases:
            res.setdefault("update", {})[mode] = _child("update", mode, str(args.rows), str(args.updates))
    if "sync" in args.phases:  # full: file (what main does), shm and socket, fp32 and bf16, interleaved
        full = _child("sync", "full")
        res["sync"] = {"full": full.pop("file"), **full, "lora": _child("sync", "lora")}
    if "decode" in args.phases:
        res["decode"] = _child("decode")
    if "big" in args.phases and not args.skip_big:
        res["big"] = _child("big", str(args.big_tokens))
    res["wall_seconds"] = round(time.time() - t0)
    if "sync" in res:
        res["sync"]["lora_vs_full_seconds"] = round(
            res["sync"]["lora"]["seconds"] / res["sync"]["full"]["seconds"], 3
        )
        res["sync"]["lora_bytes_equal_adapter"] = (
            res["sync"]["lora"]["tensor_bytes"] == res["sync"]["lora"]["trained_bytes"]
        )
        s = res["sync"]
        for way in ("shm", "socket"):  # memory / file, paired in one run
            s[f"{way}_vs_file_seconds"] = round(s[way]["seconds"] / s["full"]["seconds"], 3)
            s[f"{way}_vs_file_seconds_bf16"] = round(
                s[f"{way}_bf16"]["seconds"] / s["file_bf16"]["seconds"], 3
            )
            s[f"{way}_vs_file_cpu_seconds"] = round(s[way]["cpu_seconds"] / s["full"]["cpu_seconds"], 3)
    res["note"] = (
        "measured on a shared 2-core machine with other work running beside it: compare the ratios "
        "within one run, not absolute seconds across runs"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    sys.stdout.write(table(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
