"""How far a bf16 policy lags its fp32 masters (`train.bf16_rounding`, trainer/precision.py).

1. From the start weights alone: the share of weights whose bf16 value can move after k Adam steps of
   size lr in one direction (a step of AdamW moves a weight by about lr; a bf16 weight rounded to nearest
   moves once its master is half a bf16 step, 2^-9 of its magnitude, away).
2. From bf16 runs' checkpoints (`--checkpoint NAME=DIR`, a `train.dtype: bfloat16` run's
   checkpoints/step-N with its training/optimizer.pt): the share of weights whose bf16 value changed
   since the start, and the change the model ran with (bf16 weights − start) against the masters'
   (masters − start): the ratio of their norms, their cosine, and the share of the masters' move the
   model carries along its direction (seen·moved / |moved|²; 1 for a model that is its masters on average).

    python bench/bf16_lag.py --checkpoint nearest=RUN/checkpoints/step-14 --out bench/results/bf16_lag.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch


def visible_after(weights: list[torch.Tensor], lrs: list[float], steps: list[int]) -> dict[str, float]:
    """Share of weights (bf16 start) that k steps of size lr would move, per (lr, k)."""
    w = torch.cat([t.detach().flatten().to(torch.bfloat16).float() for t in weights])
    exponent = torch.floor(torch.log2(w.abs().clamp_min(1e-30)))
    half_step = 2.0 ** (exponent - 8)  # half the spacing of bf16 numbers at this magnitude
    return {
        f"lr={lr:g},k={k}": round(float(((k * lr) > half_step).float().mean()), 4)
        for lr in lrs
        for k in steps
    }


def lag(start_dir: Path, checkpoint: Path) -> dict[str, Any]:
    """Changed share, norm ratio and cosine of the bf16 weights' move against the masters' (docstring)."""
    from harnessrl.modeling.loading import load_model
    from harnessrl.trainer.precision import LOW_KEY, join_master

    start = load_model(start_dir, dtype=torch.bfloat16)
    end = load_model(checkpoint, dtype=torch.bfloat16)
    saved = torch.load(checkpoint / "training" / "optimizer.pt", map_location="cpu", weights_only=False)
    state = saved["optimizer"]["state"]
    ends = dict(end.named_parameters())
    changed = total = 0
    seen2 = real2 = dot = 0.0
    for i, (name, p0) in enumerate(start.named_parameters()):
        h = ends[name].detach()
        s = state.get(i, state.get(str(i)))
        if s is None or LOW_KEY not in s:
            raise SystemExit(
                f"{checkpoint}: no master low half for {name}: not a train.dtype bfloat16 checkpoint"
            )
        master = join_master(h, s[LOW_KEY])
        seen, real = h.float() - p0.detach().float(), master - p0.detach().float()
        changed += int((h != p0.detach()).sum())
        total += p0.numel()
        seen2 += float((seen * seen).sum())
        real2 += float((real * real).sum())
        dot += float((seen * real).sum())
    return {
        "weights_changed_share": round(changed / total, 4),
        "seen_over_master_norm": round((seen2 / real2) ** 0.5, 4),
        "seen_master_cosine": round(dot / (seen2 * real2) ** 0.5, 4),
        # how much of the masters' move the model carries along its direction (1: all of it, on average)
        "seen_along_master": round(dot / real2, 4),
        "low_half_dtype": str(next(iter(state.values()))[LOW_KEY].dtype),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="the start weights (a name or folder)")
    p.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from harnessrl.modeling.loading import load_model, resolve_model

    start_dir = resolve_model(args.model)
    model = load_model(start_dir, dtype=torch.float32)
    out: dict[str, Any] = {"bench": "bf16_lag", "model": args.model,
                           "visible_after_k_steps": visible_after(list(model.parameters()), [1e-6, 2e-5, 1e-4],
                                                                  [1, 3, 10])}  # fmt: skip
    del model
    for spec in args.checkpoint:
        name, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit(f"--checkpoint {spec!r}: expected NAME=DIR")
        out.setdefault("checkpoints", {})[name] = {"dir": folder, **lag(start_dir, Path(folder))}
        print(name, json.dumps(out["checkpoints"][name]), flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["visible_after_k_steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
