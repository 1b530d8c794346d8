"""The optimizer step of `train.dtype: bfloat16` (`MasterAdamW`) on SmolLM2-sized bf16 parameters (74.8M
in 91 tensors; the shapes of its layers and its embedding), one torch thread: this tree's step with
`train.bf16_rounding` nearest and stochastic, and optionally another checkout's (`--before DIR`, e.g. a
`git worktree` of the commit before a change), interleaved in one process; median CPU seconds of 5 steps.

    python bench/master_adamw_step.py --before /tmp/wt_before --out bench/results/master_adamw_step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = [(576, 576)] * 60 + [(1536, 576)] * 30 + [(49152, 576)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).mul(0.02).bfloat16()) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    return ps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--before", type=Path, help="a checkout whose src/harnessrl/trainer/precision.py to time too"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    from harnessrl.trainer import precision

    opts: dict[str, Any] = {}
    if args.before is not None:
        spec = importlib.util.spec_from_file_location(
            "before_precision", args.before / "src" / "harnessrl" / "trainer" / "precision.py"
        )
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        opts["before"] = before.MasterAdamW(_params(0), lr=2e-5, weight_decay=0.0)
    opts["nearest"] = precision.MasterAdamW(_params(0), lr=2e-5, weight_decay=0.0)
    opts["stochastic"] = precision.MasterAdamW(_params(0), lr=2e-5, weight_decay=0.0, rounding="stochastic")
    for opt in opts.values():
        opt.step()  # the state is allocated at the first step
    seconds: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(args.steps):
        for name, opt in opts.items():
            t0 = time.process_time()
            opt.step()
            seconds[name].append(time.process_time() - t0)
    median = {k: sorted(v)[len(v) // 2] for k, v in seconds.items()}
    out: dict[str, Any] = {"bench": "master_adamw_step", "params": sum(p.numel() for p in _params(0)),
                           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                    text=True, check=False).stdout.strip(),
                           "before": str(args.before) if args.before else None,
                           "cpu_seconds": seconds, "median_cpu_seconds": median,
                           "stochastic_over_nearest": round(median["stochastic"] / median["nearest"], 3)}  # fmt: skip
    if "before" in median:
        out["nearest_over_before"] = round(median["nearest"] / median["before"], 3)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "cpu_seconds"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
