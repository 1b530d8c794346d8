"""Packed rows against padded rows in the trainer's forward (`train.pack_rows`, trainer/packing.py): one
forward + backward of one micro-batch of rows of very different lengths, both ways in the same run.

    nice -n 5 python bench/packed_rows.py --out bench/results/packed_rows.json      # ~6 min on 2 cores
    nice -n 5 python bench/packed_rows.py --impl transformers --out bench/results/packed_rows_generic.json

The micro-batch: rows of `--lengths` tokens (default 300, 800 and 2,000: rollouts of an agent differ this
much), every token after `--prefix` shared ones trained (all positions selected), on SmolLM2-135M in fp32
(`--model`: a name or a folder; `--tiny`: a random llama of SmolLM2's vocabulary, 4 narrow layers), on
the builtin path or, with `--impl transformers`, on transformers' (modeling/hf_generic.py: packed rows
are one decoder call with per-row positions and a block-diagonal mask; `auto_packs` says whether
`train.pack_rows: auto` would pack this micro-batch there).
Padded, every row runs the longest row's positions in every linear layer and attention; packed, the rows
run back to back. Each repeat runs padded then packed (`selected_logprobs` with `pack` off / on, layer
checkpointing as a run decides it), the sum of the logprobs backpropagated. `cpu_ratio` is the ratio of
the median CPU seconds of the process (all threads; the work done, whatever else shares the cores),
padded over packed; `speedup` the same for wall-clock seconds, which other work on a shared machine moves
far more. `logprob_max_diff` and `grad_max_rel_diff` (over every parameter,
relative to its largest gradient entry) say the two compute the same; `--dtype float64` shows them
without fp32's rounding (the logprobs themselves are taken in fp32, modeling/logprobs.py). Only ratios
within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harnessrl.modeling.hf_generic import load_generic, packing_refusal
from harnessrl.modeling.loading import load_model, make_tiny_model_dir, resolve_model
from harnessrl.trainer.forward import selected_logprobs
from harnessrl.trainer.packing import plan_rows, use_generic_packing

NOTE = "measured on a shared 2-core machine with other work running beside it: ratios within this run"


def micro_batch(
    vocab: int, lengths: list[int], prefix: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Right-padded tokens [B, max], every position after the prefix selected, temperatures 1."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    select = torch.zeros(len(lengths), max(lengths) - 1, dtype=torch.bool)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    for b, n in enumerate(lengths):
        tokens[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        tokens[b, :prefix] = shared
        select[b, prefix : n - 1] = True
    return tokens, select, torch.ones(len(lengths), dtype=dtype)


def cpu_seconds() -> float:
    """CPU seconds this process has used (all threads): its work, whatever else shares the cores."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def step(model: Any, batch: tuple[torch.Tensor, ...], prefix: int, pack: str) -> tuple[float, Any, dict]:
    """Seconds of one forward + backward, the logprobs, the gradients (`step_cpu`: with CPU seconds)."""
    seconds, _, lp, grads = step_cpu(model, batch, prefix, pack)
    return seconds, lp, grads


def step_cpu(
    model: Any, batch: tuple[torch.Tensor, ...], prefix: int, pack: str
) -> tuple[float, float, Any, dict]:
    """Wall and CPU seconds of one forward + backward, the logprobs, the gradients."""
    tokens, select, temps = batch
    model.zero_grad(set_to_none=True)
    if tokens.is_cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), cpu_seconds()
    sel = selected_logprobs(model, tokens, select, temps, prefix, pack=pack)
    sel.logprobs.sum().backward()
    if tokens.is_cuda:
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return seconds, cpu, sel.logprobs.detach(), grads


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tiny", action="store_true", help="a random 4-layer llama instead of --model")
    ap.add_argument("--impl", choices=["builtin", "transformers"], default="builtin", help="the model path")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="float64: the two's differences without fp32 rounding")  # fmt: skip
    ap.add_argument("--lengths", type=int, nargs="+", default=[300, 800, 2000])
    ap.add_argument("--prefix", type=int, default=0, help="tokens every row shares (run once)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tiny:
        model_dir = make_tiny_model_dir(
            Path(tempfile.mkdtemp()) / "tiny", hidden=256, layers=4, intermediate=768
        )
    else:
        model_dir = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    model: Any = (
        load_generic(model_dir, dtype) if args.impl == "transformers" else load_model(model_dir, dtype)
    )
    model.train()
    batch = micro_batch(model.config.vocab_size, args.lengths, args.prefix, dtype=dtype)
    auto = None
    if args.impl == "transformers":
        plan = plan_rows(batch[1], 0)
        auto = use_generic_packing(
            "auto", plan, max(args.lengths), packing_refusal(model.config), model.flops
        )
    step(model, micro_batch(model.config.vocab_size, [40, 20], 0, dtype=dtype), 0, "on")  # warm-up
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for pack in ("off", "on"):
            seconds, used, lp, grads = step_cpu(model, batch, args.prefix, pack)
            times[pack].append(round(seconds, 3))
            cpu[pack].append(round(used, 3))
            if pack == "off":
                lp_padded, grads_padded = lp, {n: g.clone() for n, g in grads.items()}
    lp_diff = float((lp - lp_padded).abs().max())
    grad_diff = max(
        float((grads[n] - g).abs().max() / g.abs().max())
        for n, g in grads_padded.items()
        if g.abs().max() > 0
    )
    padded_s, packed_s = statistics.median(times["off"]), statistics.median(times["on"])
    padded_cpu, packed_cpu = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    suffixes = [n - args.prefix for n in args.lengths]
    res = {
        "model": "tiny" if args.tiny else args.model, "impl": args.impl, "auto_packs": auto,
        "dtype": args.dtype, "lengths": args.lengths,
        "prefix": args.prefix, "threads": args.threads, "repeats": args.repeats,
        "padded_positions": len(suffixes) * max(suffixes), "packed_positions": sum(suffixes) - len(suffixes),
        "padded_cpu_s": cpu["off"], "packed_cpu_s": cpu["on"], "padded_median_cpu_s": padded_cpu,
        "packed_median_cpu_s": packed_cpu, "cpu_ratio": round(padded_cpu / packed_cpu, 2),
        "padded_s": times["off"], "packed_s": times["on"], "padded_median_s": padded_s,
        "packed_median_s": packed_s, "speedup": round(padded_s / packed_s, 2),
        "logprob_max_diff": lp_diff, "grad_max_rel_diff": grad_diff,
        "torch": torch.__version__, "cpu": cpu_model(),
        "command": "python " + " ".join(sys.argv), "note": NOTE, "load_avg_at_end": os.getloadavg(),
    }  # fmt: skip
    text = json.dumps(res, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
