"""`train.dtype: bfloat16` against float32 on the same rows: part of `make bench-scale` (`bench/scale.py`), or
alone (each phase in a fresh process, so a peak is its own):

    python bench/scale_bf16.py --model smollm2 --groups 1 --rows 4 --updates 1 --skip-fsdp --out bench/results/scale_bf16.json
    python bench/scale_bf16.py --model smollm2 --groups 1 --rows 8 --updates 1 --skip-fsdp --matmul auto \
        --exp-avg-dtype bfloat16 --exactness-updates 5 --exactness-rows 2 --out /tmp/scale_exp_avg.json

- `update_peak_mb_ratio_vs_fp32`: the trainer process's peak RSS (VmHWM, reset after loading) over
  `--updates` PPO updates of the same rows, bf16 (MasterAdamW: bf16 weights and gradients, int16 low
  halves, fp32 moments) over fp32 (AdamW). The optimizer state is made first (one step with zero
  gradients, which leaves every weight as it is), so the update measured holds it throughout, as every
  update after a run's first does. Layers are not checkpointed here (`checkpoint_layers=False`), so the
  activations, which bf16 halves, are part of the peak as in a long-row update; the state alone is
  14 bytes a parameter against 16, so the fewer the tokens the nearer the ratio is to 14/16.
  `--exp-avg-dtype bfloat16` (`train.exp_avg_dtype`): the bf16 phase keeps AdamW's first moment in bf16,
  12 bytes a parameter against 16; a third phase, bf16 with fp32 moments (`bf16_exp_avg_float32`), gives
  `exp_avg_float32_update_peak_mb_ratio_vs_fp32` in the same run.
- `exactness` (`--exactness-updates N`, with `--exp-avg-dtype bfloat16`): N PPO updates of bf16 weights on
  `--exactness-rows` rows, each gradient stepped by two MasterAdamW, the exact one (fp32 moments, whose
  weights compute the gradients) and one with a bf16 first moment (its own copy of the weights), so the
  two differ by the first moment's rounding alone. After each update: the largest |difference| of their
  fp32 master weights over the largest |step| of the exact one (`max_weight_diff_over_max_update`), and
  the L2 norm of the difference of their steps over the exact step's (`update_rel_l2`).
- `logprob_max_diff_vs_fp32` / `logprob_mean_diff_vs_fp32`: |bf16 − fp32| of the trainer's logprobs of
  every trainable token of the rows, before any update.
- `fsdp_2rank_vs_1rank_max_weight_diff` (not with `--skip-fsdp`): 2 FSDP ranks (fp32 shards, bf16 compute,
  fp32 reduction) against 1 process in bf16 (MasterAdamW), one update of the same rows: the largest
  difference of the fp32 master weights (which includes the bf16 rounding of the one process's starting
  weights), `fsdp_2rank_vs_1rank_max_step_diff` the largest difference of the two steps (after − before);
  `fp32_step_max_change` is how far one fp32 step moved any weight.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale

from bench.scale_common import finish, reset_peak, run_json, status_mb


def _make_state(model: Any, optimizer: Any) -> None:
    """The optimizer's state (moments; a bf16 parameter's low half), as after a first update: one step
    with zero gradients (Adam's step is then 0 and no weight decays), the gradients freed again."""
    import torch

    from harnessrl.modeling.memory import release_freed_memory

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()


def phase_update(
    model_name: str,
    dtype_name: str,
    groups: int,
    rows: int,
    updates: int,
    matmul: str = "aten",
    exp_avg_dtype: str = "float32",
) -> dict[str, Any]:
    """`updates` PPO updates of one dtype: peak RSS, the logprobs before the first, seconds."""
    import torch
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.packed import use_onednn_for_training
    from harnessrl.trainer.forward import selected_logprobs
    from harnessrl.trainer.ppo import PPOConfig, _pack, ppo_update
    from harnessrl.trainer.precision import make_optimizer, torch_dtype

    dtype = torch_dtype(dtype_name)
    model = load_model(model_name, dtype=dtype)
    matmul_path = use_onednn_for_training(model, matmul, torch.device("cpu"))  # as a run's train.matmul
    batch = demo_batch(groups, rows)
    packed = _pack(batch, list(range(len(batch.rows))), torch.device("cpu"))
    with torch.no_grad():
        lp = selected_logprobs(model, packed.tokens, packed.select, packed.temps, packed.prefix).logprobs
    optimizer = make_optimizer(
        model.parameters(), dtype, lr=1e-5, weight_decay=0.0, exp_avg_dtype=exp_avg_dtype
    )
    _make_state(model, optimizer)
    cfg = PPOConfig(micro_batch_tokens=1 << 20)  # the whole batch one micro-batch
    rss_before = status_mb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    for _ in range(updates):
        ppo_update(model, optimizer, batch, cfg, checkpoint_layers=False)
    peak = status_mb("VmHWM")
    return {"dtype": dtype_name, "exp_avg_dtype": exp_avg_dtype, "matmul": matmul_path, "rss_before_mb": rss_before, "peak_mb": peak, "update_mb": peak - rss_before,
            "seconds": round(time.perf_counter() - t0, 1), "logprobs": [float(x) for x in lp],
            "rows": len(batch.rows), "tokens": sum(len(r.tokens) for r in batch.rows)}  # fmt: skip


def phase_exactness(model_name: str, rows: int, updates: int, matmul: str) -> dict[str, Any]:
    """The `exactness` figures of the module docstring."""
    import torch
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.packed import use_onednn_for_training
    from harnessrl.trainer.ppo import PPOConfig, ppo_update
    from harnessrl.trainer.precision import MasterAdamW, master_weights

    model = load_model(model_name, dtype=torch.bfloat16)
    use_onednn_for_training(model, matmul, torch.device("cpu"))
    params = list(model.parameters())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    rounded = MasterAdamW(twins, lr=1e-5, weight_decay=0.0, exp_avg_dtype="bfloat16")

    class Both(MasterAdamW):
        """The exact MasterAdamW; each step also steps the twins with the same gradients."""

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            for p, t in zip(params, twins, strict=True):
                t.grad = p.grad
            rounded.step()
            for t in twins:
                t.grad = None
            return super().step(closure)

    exact = Both(params, lr=1e-5, weight_decay=0.0)
    batch, cfg = demo_batch(1, rows), PPOConfig(micro_batch_tokens=1 << 20)
    out: list[dict[str, float]] = []
    for _ in range(updates):
        before = [master_weights(exact, p).clone() for p in params]
        before_r = [master_weights(rounded, t).clone() for t in twins]
        ppo_update(model, exact, batch, cfg, checkpoint_layers=False)
        step = max(
            float((master_weights(exact, p) - b).abs().max()) for p, b in zip(params, before, strict=True)
        )
        gap = max(float((master_weights(exact, p) - master_weights(rounded, t)).abs().max())
                  for p, t in zip(params, twins, strict=True))  # fmt: skip
        num = den = 0.0
        for p, t, b, br in zip(params, twins, before, before_r, strict=True):
            want, got = master_weights(exact, p) - b, master_weights(rounded, t) - br
            num += float((got - want).double().square().sum())
            den += float(want.double().square().sum())
        out.append({"max_weight_diff_over_max_update": gap / step, "update_rel_l2": (num / den) ** 0.5,
                    "max_update": step})  # fmt: skip
        del before, before_r
    return {"exactness": {"rows": rows, "updates": updates, "lr": 1e-5, "by_update": out}}


def phase_fsdp(model_name: str, groups: int, rows: int) -> dict[str, Any]:
    """One update of the same rows: 2 FSDP ranks in bf16 against 1 bf16 process and 1 fp32 process."""
    import torch
    from bench.scale import demo_batch

    from harnessrl.modeling.loading import load_model, resolve_model
    from harnessrl.trainer.distributed import DataParallel
    from harnessrl.trainer.ppo import PPOConfig, ppo_update
    from harnessrl.trainer.precision import make_optimizer, master_weights

    model_dir = resolve_model(model_name)
    batch, cfg = demo_batch(groups, rows), PPOConfig()  # (a folder, or a name)
    one = load_model(model_dir, dtype=torch.bfloat16)
    start1 = {n: p.detach().float() for n, p in one.named_parameters()}  # the bf16 master's start
    opt1 = make_optimizer(one.parameters(), torch.bfloat16, lr=1e-5, weight_decay=0.0)
    ppo_update(one, opt1, batch, cfg)
    fp32 = load_model(model_dir)
    start = {n: p.detach().clone() for n, p in fp32.named_parameters()}
    ppo_update(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-5, weight_decay=0.0), batch, cfg)
    change = max(float((p.detach() - start[n]).abs().max()) for n, p in fp32.named_parameters())
    del fp32, start
    model = load_model(model_dir)
    start2 = {n: p.detach().clone() for n, p in model.named_parameters()}  # fp32 shards' start
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    with tempfile.TemporaryDirectory() as logs:
        dp = DataParallel(
            model, opt2, model_dir, 2, threads=1, log_dir=Path(logs), parallel="fsdp", dtype="bfloat16"
        )
        try:
            t0 = time.perf_counter()
            dp.update(batch, cfg)
            seconds = time.perf_counter() - t0
            full = dp.full_model().state_dict()
        finally:
            dp.close()
    gap = max(
        float((master_weights(opt1, p) - full[n].float()).abs().max()) for n, p in one.named_parameters()
    )
    # the steps themselves: the fp32 shards start from the folder's fp32 weights, the one bf16 process
    # from them rounded to bf16 (its master keeps no bits it never had), so the weights differ by that
    # rounding before any step; the updates are what the two schedules compute
    step_gap = max(
        float(((master_weights(opt1, p) - start1[n]) - (full[n].float() - start2[n])).abs().max())
        for n, p in one.named_parameters()
    )
    return {"fsdp_2rank_vs_1rank_max_weight_diff": gap, "fsdp_2rank_vs_1rank_max_step_diff": step_gap,
            "fp32_step_max_change": change, "fsdp_2rank_update_s": round(seconds, 1)}  # fmt: skip


def _child(*args: str) -> dict[str, Any]:
    return run_json(__file__, "--phase", *args)


def bench_bf16(
    model: str,
    groups: int,
    rows: int,
    updates: int,
    fsdp: bool = True,
    matmul: str = "aten",
    exp_avg_dtype: str = "float32",
    exactness_updates: int = 0,
    exactness_rows: int = 2,
) -> dict[str, Any]:
    """The figures of the module docstring (`model`: a name, a folder, or small-random as in scale_fsdp)."""
    import torch
    from bench.scale_fsdp import _model_dir

    model = str(_model_dir(model))
    f32 = _child("update", model, "float32", str(groups), str(rows), str(updates), matmul)
    b16 = _child("update", model, "bfloat16", str(groups), str(rows), str(updates), matmul, exp_avg_dtype)
    exact = None  # with a bf16 first moment: the bf16 update with fp32 moments too, in the same run
    if exp_avg_dtype != "float32":
        exact = _child("update", model, "bfloat16", str(groups), str(rows), str(updates), matmul, "float32")
    diffs = [abs(a - b) for a, b in zip(f32.pop("logprobs"), b16.pop("logprobs"), strict=True)]
    out: dict[str, Any] = {
        "model": model, "updates": updates, "fp32": f32, "bf16": b16,
        "update_peak_mb_ratio_vs_fp32": round(b16["peak_mb"] / f32["peak_mb"], 3),
        # what the update itself added above the loaded model (gradients, moments, activations)
        "update_added_mb_ratio_vs_fp32": round(b16["update_mb"] / max(f32["update_mb"], 1), 3),
        "logprob_max_diff_vs_fp32": max(diffs), "logprob_mean_diff_vs_fp32": sum(diffs) / len(diffs),
        "trainable_tokens": len(diffs), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }  # fmt: skip
    if exact is not None:
        exact.pop("logprobs")
        out["bf16_exp_avg_float32"] = exact
        out["exp_avg_float32_update_peak_mb_ratio_vs_fp32"] = round(exact["peak_mb"] / f32["peak_mb"], 3)
    if exactness_updates:
        out.update(_child("exactness", model, str(exactness_rows), str(exactness_updates), matmul))
    if fsdp:
        out.update(_child("fsdp", model, str(groups), str(rows)))
    return out


def main() -> int:
    """Command line: see the module docstring."""
    if sys.argv[1:2] == ["--phase"]:
        name, *rest = sys.argv[2:]
        if name == "update":
            res = phase_update(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), *rest[5:])
        elif name == "exactness":
            res = phase_exactness(rest[0], int(rest[1]), int(rest[2]), rest[3])
        else:
            res = phase_fsdp(rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(res))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--skip-fsdp", action="store_true")
    p.add_argument("--matmul", choices=["aten", "auto"], default="aten",
                   help="the linear layers' path as train.matmul; auto: bf16 through fp32 products on a CPU "
                   "without fast bf16 ones (modeling/upcast.py), fp32 through oneDNN when its probe agrees")  # fmt: skip
    p.add_argument("--exp-avg-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="train.exp_avg_dtype of the bf16 phase: AdamW's first moment in bf16 or fp32")  # fmt: skip
    p.add_argument("--exactness-updates", type=int, default=0,
                   help="PPO updates of the exactness phase (0: none): bf16 vs fp32 first moment, same gradients")  # fmt: skip
    p.add_argument("--exactness-rows", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    res = bench_bf16(args.model, args.groups, args.rows, args.updates, not args.skip_fsdp, args.matmul,
                     args.exp_avg_dtype, args.exactness_updates, args.exactness_rows)  # fmt: skip
    return finish(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
