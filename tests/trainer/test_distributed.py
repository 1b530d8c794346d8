"""Data-parallel training (train.world_size): 2 CPU ranks over gloo give the single-process update, step
after step, with the replicas in lockstep; a rank without rows still joins; resume works with k ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch
from harnessrl.modeling.loading import load_model
from harnessrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from harnessrl.trainer.distributed import DataParallel, shard_rows
from harnessrl.trainer.ppo import PPOConfig, lr_lambda, ppo_update
from harnessrl.trainer.precision import make_optimizer
from tests.trainer.test_ppo import random_batch

# Largest absolute weight difference allowed between the 2-rank and the 1-rank update. Measured on this
# machine: about 1e-9 or below (float summation order only); bench/scale.py records the figure.
WEIGHT_TOL = 1e-6


def _trainer(
    model_dir: Path,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", 1, 4, 0.1))
    return model, opt, sched


def max_weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((x.detach() - y.detach()).abs().max())
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_rows_are_split_by_token_budget() -> None:
    batch = random_batch(30, seed=4)
    rows = list(range(30))
    for k in (1, 2, 3):
        shards = shard_rows(batch, rows, k)
        assert sorted(i for s in shards for i in s) == rows
        ordered = sorted(rows, key=lambda i: batch.rows[i].tokens)
        assert [i for s in shards for i in s] == ordered  # contiguous runs in token order
        tokens = [sum(len(batch.rows[i].tokens) for i in s) for s in shards]
        longest = max(len(r.tokens) for r in batch.rows)
        assert max(tokens) - min(tokens) <= 2 * longest, tokens
    assert shard_rows(batch, [5], 2) == [[5], []]


@pytest.mark.slow  # heavy for the suite's 15 minutes: `pytest -m slow` runs it
def test_two_ranks_give_the_single_process_update_and_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Three updates side by side (1 rank, 2 ranks), the last one leaving rank 1 without rows; then a
    resume from the checkpoint of update 1 on the same ranks gives update 2 again."""
    cfg = PPOConfig(micro_batch_tokens=96)  # several micro-batches per rank: accumulation, then one reduce
    batches = [random_batch(12, seed=s) for s in (21, 22)]
    lone = Batch([batches[0].rows[0]], [0.7], [batches[0].weights[0]], {})  # rank 1 gets no row
    single, opt1, sched1 = _trainer(tiny_model_dir)
    model, opt2, sched2 = _trainer(tiny_model_dir)
    dp = DataParallel(model, opt2, tiny_model_dir, 2, threads=1, log_dir=tmp_path)  # type: ignore[arg-type]
    diffs, m1, m2 = [], [], []
    try:
        for step, b in enumerate((*batches, lone), start=1):
            m1.append(ppo_update(single, opt1, b, cfg, scheduler=sched1))  # type: ignore[arg-type]
            m2.append(dp.update(b, cfg, scheduler=sched2))
            assert dp.divergence() == 0.0  # every rank took the same step
            diffs.append(max_weight_diff(single, model))
            if step == 1:
                save_checkpoint(tmp_path / "ckpt", 1, model, opt2, {}, sched2)  # type: ignore[arg-type]
            if step == 2:
                after_two = [p.detach().clone() for p in model.parameters()]
        # resume: rank 0 loads the checkpoint, the other ranks take its state
        load_checkpoint(tmp_path / "ckpt" / "step-1", model, opt2, sched2)  # type: ignore[arg-type]
        assert dp.divergence() > 0  # rank 1 is still at update 3
        dp.sync_state()
        assert dp.divergence() == 0.0
        dp.update(batches[1], cfg, scheduler=sched2)
        assert dp.divergence() == 0.0
        gap = max(
            float((a - b.detach()).abs().max()) for a, b in zip(after_two, model.parameters(), strict=True)
        )
    finally:
        dp.close()
    print(
        f"ddp_2rank_max_weight_diff after steps 1..3: {', '.join(f'{d:.2e}' for d in diffs)}; resume {gap:.2e}"
    )
    assert diffs[0] < WEIGHT_TOL  # one step: float summation order only
    assert max(diffs) < 10 * WEIGHT_TOL  # AdamW's later steps carry the first step's rounding on
    assert gap < WEIGHT_TOL
    for a, b in zip(m1, m2, strict=True):
        # the loss and the pre-clip gradient norm are the whole batch's: a mean instead of a sum over
        # ranks would halve the norm (AdamW alone would hide it)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=1e-9)
        assert b["lr"] == a["lr"]
    assert m2[0]["ranks"] == 2.0 and m2[0]["rank_rows_max"] < 12


def test_two_ranks_sum_to_the_whole_batch_gradient(tiny_model_dir: Path) -> None:
    """With SGD at lr 1 and no clipping, the weight change is the gradient itself: compared directly."""
    cfg = PPOConfig(micro_batch_tokens=96, max_grad_norm=1e9)
    batch = random_batch(12, seed=23)
    single = load_model(tiny_model_dir)
    before = [p.detach().clone() for p in single.parameters()]
    ppo_update(single, torch.optim.SGD(single.parameters(), lr=1.0), batch, cfg)
    model = load_model(tiny_model_dir)
    dp = DataParallel(model, torch.optim.SGD(model.parameters(), lr=1.0), tiny_model_dir, 2, threads=1)
    try:
        dp.update(batch, cfg)
        assert dp.divergence() == 0.0  # rank 1 built an SGD too
        dp.procs[0].kill()  # a rank that dies: the next update says so instead of hanging
        dp.procs[0].wait()
        with pytest.raises(RuntimeError, match=r"trainer rank\(s\) exited: \[\(1, -9\)\]"):
            dp.update(batch, cfg)
    finally:
        dp.close()
    for w0, a, b in zip(before, single.parameters(), model.parameters(), strict=True):
        g1, g2 = w0 - a.detach(), w0 - b.detach()
        # read back from float32 weights, a gradient is known to one unit in the last place of its
        # weight (2**-29 for |w| in [1/64, 1/32)): two equal gradients can round one unit apart
        ulp = float(torch.finfo(w0.dtype).eps * w0.abs().max())
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=max(1e-9, ulp))
    assert any(
        float((w0 - a.detach()).abs().max()) > 1e-6 for w0, a in zip(before, single.parameters(), strict=True)
    )


def test_two_bf16_ranks_with_a_bf16_first_moment_stay_in_lockstep(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """train.dtype bfloat16 with train.exp_avg_dtype bfloat16 on 2 ddp ranks: rank 1 builds rank 0's
    MasterAdamW (weight decay and the bf16 first moment included), so the replicas take the same steps."""
    cfg = PPOConfig(micro_batch_tokens=96)
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    opt = make_optimizer(model.parameters(), torch.bfloat16, 1e-2, 0.0, exp_avg_dtype="bfloat16")
    dp = DataParallel(model, opt, tiny_model_dir, 2, threads=1, log_dir=tmp_path, dtype="bfloat16")  # type: ignore[arg-type]
    try:
        for seed in (31, 32, 33):
            dp.update(random_batch(12, seed=seed), cfg)
            assert dp.divergence() == 0.0
    finally:
        dp.close()
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in model.parameters())
