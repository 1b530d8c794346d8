"""Sharded ranks (`train.parallel: fsdp`, FSDP2 over gloo) against one process, on the same weights and
batches: part of `make bench-scale` (`bench/scale.py`), or alone:

    python bench/scale_fsdp.py --model smollm2 --updates 3      # prints the figures as JSON

- `fsdp_2rank_max_weight_diff`: the largest absolute weight difference between 2 sharded ranks and
  1 process after `--updates` AdamW updates (fp32; each update a different calc-shaped batch).
- `fsdp_rank_peak_mb_ratio`: the most bytes of parameters + gradients + optimizer state rank 0 held at
  any micro-batch's end (`trainer.fsdp.local_state_bytes`: a shard counts its local part), over the same
  figure of the 1-process trainer. From the second update on all three exist at every backward.
- `gather_s` / `push_s`: gathering the full weights on rank 0, and that plus writing the safetensors
  folder an engine loads (`save_model`), against writing it from one process (`push_s_1rank`).
- `--model small-random`: SmolLM2's vocabulary with 4 layers of width 256 (16M parameters, random
  weights), where SmolLM2-135M takes too long (a machine shared by other jobs).
- resume: the 2-rank checkpoint of update 1 resumed by 1 process, which then does update 2
  (`resume_2to1_max_weight_diff` against the uninterrupted 1-process run); that process's checkpoint
  resumed by 2 sharded ranks, which then do update 3 (`resume_1to2_max_weight_diff`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale


SMALL = "small-random"  # --model small-random: a 16M-parameter model for a loaded machine


def _gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k].detach() - b[k].detach()).abs().max()) for k in a if k != "lm_head.weight")


def _snapshot(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _model_dir(model_name: str) -> Path:
    from harnessrl.modeling.loading import make_tiny_model_dir, resolve_model

    if model_name == SMALL:  # SmolLM2's tokenizer and vocabulary, 4 narrow layers, random weights
        return make_tiny_model_dir(Path(tempfile.mkdtemp()) / SMALL, hidden=256, layers=4, intermediate=768)
    return resolve_model(model_name)


def _state_bytes(model: Any, opt: Any) -> int:
    from harnessrl.trainer.fsdp import local_state_bytes

    return sum(local_state_bytes(model, opt).values())


def _one_process(
    fresh: Any, batches: list[Any], cfg: Any
) -> tuple[list[int], list[dict[str, Any]], list[float]]:
    """The 1-process updates: peak state bytes after each micro-batch, weights after each update, times."""
    from harnessrl.trainer.ppo import ppo_update

    single, opt = fresh()
    peak, after, times = [0], [], []
    for b in batches:
        t0 = time.perf_counter()
        ppo_update(single, opt, b, cfg, progress=lambda d, n: peak.append(_state_bytes(single, opt)))
        times.append(time.perf_counter() - t0)
        after.append(_snapshot(single))
    return peak, after, times


def _resumes(
    dp: Any, fresh: Any, batches: list[Any], after: list[Any], cfg: Any, tmp: Path
) -> tuple[float, float]:
    """The 2-rank checkpoint of update 1 resumed by 1 process (then update 2), and that process's
    checkpoint resumed by the 2 ranks (then update 3): their differences to the 1-process run."""
    from harnessrl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from harnessrl.trainer.ppo import ppo_update

    n = len(batches)
    resumed, opt = fresh()
    load_checkpoint(tmp / "ck2" / "step-1", resumed, opt)
    ppo_update(resumed, opt, batches[1 % n], cfg)
    to_one = _gap(after[1 % n], resumed.state_dict())
    save_checkpoint(tmp / "ck1", 2, resumed, opt, {})
    dp.load_checkpoint(tmp / "ck1" / "step-2")
    dp.update(batches[2 % n], cfg)
    return to_one, _gap(after[2 % n], dp.full_model().state_dict())


def bench_fsdp(model_name: str, groups: int, rows: int, threads: int, updates: int = 3) -> dict[str, Any]:
    """The figures of the module docstring."""
    import torch
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model, save_model
    from harnessrl.trainer.distributed import DataParallel
    from harnessrl.trainer.ppo import PPOConfig

    model_dir = _model_dir(model_name)
    batches = [demo_batch(groups, rows, seed=s) for s in range(updates)]
    cfg = PPOConfig()

    def fresh() -> tuple[Any, Any]:
        model = load_model(model_dir)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    torch.set_num_threads(threads)
    peak1, after, t1 = _one_process(fresh, batches, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_model(load_model(model_dir), Path(tmp) / "one")
        push1 = time.perf_counter() - t0
        model, opt2 = fresh()
        dp = DataParallel(model, opt2, model_dir, 2, threads=max(1, threads // 2), parallel="fsdp")
        peak2, diffs, t2 = [0], [], []
        try:
            for i, b in enumerate(batches):
                t0 = time.perf_counter()
                dp.update(b, cfg, progress=lambda d, n: peak2.append(_state_bytes(model, opt2)))
                t2.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                view = dp.full_model()
                gather = time.perf_counter() - t0
                save_model(view, Path(tmp) / "two")
                push2 = time.perf_counter() - t0
                diffs.append(_gap(after[i], view.state_dict()))
                if i == 0:
                    dp.save_checkpoint(Path(tmp) / "ck2", 1, {})
            to_one, to_two = _resumes(dp, fresh, batches, after, cfg, Path(tmp))
        finally:
            dp.close()
    moved = _gap(after[-1], fresh()[0].state_dict())
    return {
        "model": str(model_name), "updates": updates, "rows_per_update": len(batches[0].rows),
        "threads_total": threads, "fsdp_2rank_max_weight_diff": max(diffs), "max_weight_diff_by_update": diffs,
        "max_weight_change_of_the_updates": moved,
        "rank_peak_mb_1rank": max(peak1) / 2**20, "rank_peak_mb_2rank": max(peak2) / 2**20,
        "fsdp_rank_peak_mb_ratio": max(peak2) / max(peak1),
        "update_s_1rank": t1, "update_s_2rank": t2,
        "gather_s": gather, "push_s": push2, "push_s_1rank": push1,
        "resume_2to1_max_weight_diff": to_one, "resume_1to2_max_weight_diff": to_two,
    }  # fmt: skip


def main() -> int:
    """Print the figures as JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help=f"a model name or folder, or {SMALL}")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--rows", type=int, default=2, help="rows per group")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    print(json.dumps(bench_fsdp(args.model, args.groups, args.rows, args.threads, args.updates), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
