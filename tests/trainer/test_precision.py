"""train.dtype bfloat16: exact fp32 master weights split into a bf16 half and an int16 low half, AdamW on
them equal to fp32 AdamW bit for bit, the KL reference in bf16 (k3 exactly 0 before the first step), and
the engine/trainer gap reported per update so a precision mismatch shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, Row
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.packed import use_onednn_for_training
from harnessrl.modeling.reference import reference_model
from harnessrl.modeling.upcast import install_upcast, needs_upcast, uses_upcast
from harnessrl.trainer.forward import selected_logprobs
from harnessrl.trainer.ppo import PPOConfig, _pack, ppo_update
from harnessrl.trainer.precision import (
    LOW_KEY,
    MasterAdamW,
    join_master,
    make_optimizer,
    master_weights,
    split_master,
    torch_dtype,
)
from tests.trainer.test_ppo import random_batch


def test_split_master_is_exact_and_rounds_to_nearest() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g) * torch.logspace(-30, 30, 50_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -3.4e38])])
    high, low = split_master(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(join_master(high, low).view(torch.int32), x.view(torch.int32))
    # the bf16 half is the nearest bf16 (torch's own rounding, up to ties)
    assert float((high == x.to(torch.bfloat16)).float().mean()) > 0.999
    normal = x[:50_000]  # (1e-40 and -3.4e38 lie outside bf16's normal range: subnormal, and -inf)
    assert float(((high[:50_000].float() - normal).abs() / normal.abs()).max()) <= 2**-8


def test_master_adamw_equals_fp32_adamw_on_the_master_weights() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 24, generator=g).bfloat16().float()
    grads = [torch.randn(48, 24, generator=g).bfloat16() for _ in range(6)]
    p32 = torch.nn.Parameter(w.clone())
    ref = torch.optim.AdamW([p32], lr=3e-3, weight_decay=0.1)
    p16 = torch.nn.Parameter(w.bfloat16())
    opt = make_optimizer([p16], torch.bfloat16, lr=3e-3, weight_decay=0.1)
    assert isinstance(opt, MasterAdamW)
    for grad in grads:
        p32.grad, p16.grad = grad.float(), grad.clone()
        ref.step()
        opt.step()
    assert torch.equal(master_weights(opt, p16), p32.detach())  # bit for bit
    assert not torch.equal(p32.detach().bfloat16().float(), p32.detach())  # the low half carries bits
    # a checkpoint round trip keeps the moments fp32 and the low halves int16 (the base class would cast)
    again = torch.nn.Parameter(p16.detach().clone())
    opt2 = MasterAdamW([again], lr=3e-3, weight_decay=0.1)
    opt2.load_state_dict(opt.state_dict())
    st = opt2.state[again]
    assert st["exp_avg"].dtype == torch.float32 and st[LOW_KEY].dtype == torch.int16
    assert torch.equal(master_weights(opt2, again), p32.detach())


def test_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"train\.dtype"):
        torch_dtype("float16")


def _engine_batch(model: torch.nn.Module, seed: int) -> Batch:
    """A batch whose behaviour logprobs are `model`'s own (as an engine in that precision reports them)."""
    batch = random_batch(6, seed=seed)
    packed = _pack(batch, list(range(len(batch.rows))), torch.device("cpu"))
    with torch.no_grad():
        sel = selected_logprobs(model, packed.tokens, packed.select, packed.temps, packed.prefix)  # type: ignore[arg-type]
    rows = []
    for j, row in enumerate(batch.rows):
        old = [0.0] * len(row.tokens)
        for lp, r, t in zip(sel.logprobs, sel.row, sel.pos, strict=True):
            if int(r) == j:
                old[int(t) + 1] = float(lp)
        rows.append(Row(row.rollout_id, row.tokens, row.loss_mask, old, row.temperature))
    return Batch(rows, batch.advantages, batch.weights, {})


def test_bf16_update_with_a_bf16_reference(tiny_model_dir: Path) -> None:
    """The bf16 policy against an fp32 engine's logprobs: the gap shows in the metrics; the KL to the
    bf16 reference is exactly 0 before the first step; one step moves the weights as fp32 does."""
    fp32 = load_model(tiny_model_dir)
    batch = _engine_batch(fp32, seed=5)
    cfg = PPOConfig(kl_coef=0.05, tis_cap=2.0)
    m32 = ppo_update(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-3), batch, cfg,
                     ref_model=reference_model(fp32, tiny_model_dir, "cpu", None))  # fmt: skip
    bf16 = load_model(tiny_model_dir, dtype=torch.bfloat16)
    ref = reference_model(bf16, tiny_model_dir, "cpu", None, torch.bfloat16)
    assert next(ref.parameters()).dtype == torch.bfloat16
    opt = make_optimizer(bf16.parameters(), torch.bfloat16, lr=1e-3, weight_decay=0.01)
    m16 = ppo_update(bf16, opt, batch, cfg, ref_model=ref)
    assert m32["kl"] == 0.0 and m16["kl"] == 0.0  # one epoch: the policy is the reference
    assert m32["mismatch_max"] < 1e-5 and m32["tis_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m16["mismatch_max"] > 1e-3  # bf16 trainer vs fp32 engine: visible
    assert m16["mismatch_max"] >= m16["mismatch"] > 0 and m16["tis_ratio_max"] >= m16["tis_ratio_mean"]
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05, abs=1e-3)
    after32 = dict(fp32.named_parameters())
    moved = [
        float((master_weights(opt, p) - after32[n].detach()).abs().max()) for n, p in bf16.named_parameters()
    ]
    assert max(moved) < 2e-2  # the same step up to bf16 rounding of weights and gradients
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_upcast_linear_is_the_fp32_product_rounded_to_bf16() -> None:
    """modeling/upcast.py: forward and backward of a bf16 linear layer through fp32 products equal the fp32
    products of the same bf16 values, rounded once to bf16 (what a GPU's bf16 GEMM returns)."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(40, 24, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 7, 40, generator=g).bfloat16().requires_grad_(True)
    grad = torch.randn(2, 7, 24, generator=g).bfloat16()
    x32 = x.detach().float().requires_grad_(True)
    w32, b32 = (t.detach().float().requires_grad_(True) for t in (lin.weight, lin.bias))
    y32 = torch.nn.functional.linear(x32, w32, b32)
    y32.backward(grad.float())
    assert install_upcast(lin) == 1 and uses_upcast(lin)
    y = lin(x)
    y.backward(grad)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.detach().bfloat16())
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    for got, want in ((x.grad, x32.grad), (lin.weight.grad, w32.grad), (lin.bias.grad, b32.grad)):
        assert got.dtype == torch.bfloat16 and torch.allclose(
            got.float(), want.bfloat16().float(), rtol=0, atol=0
        )


def test_auto_matmul_upcasts_bf16_where_the_cpu_has_no_fast_bf16(tiny_model_dir: Path) -> None:
    """`train.matmul: auto` on bf16 weights: fp32 products exactly where `needs_upcast` says so; the
    logprobs stay as close to fp32's as bf16 products' are; the bf16 reference follows the policy."""
    fp32 = load_model(tiny_model_dir)
    batch = _engine_batch(fp32, seed=7)
    packed = _pack(batch, list(range(len(batch.rows))), torch.device("cpu"))

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return selected_logprobs(
                model, packed.tokens, packed.select, packed.temps, packed.prefix
            ).logprobs  # type: ignore[arg-type]

    plain = load_model(tiny_model_dir, dtype=torch.bfloat16)
    routed = load_model(tiny_model_dir, dtype=torch.bfloat16)
    reason = use_onednn_for_training(routed, "auto", torch.device("cpu"))
    upcast = needs_upcast(torch.bfloat16, torch.device("cpu"))
    assert reason.startswith("fp32 products") == upcast == uses_upcast(routed)
    if not upcast:  # this CPU has fast bf16 products: route by hand to check the values all the same
        install_upcast(routed)
    ref = reference_model(routed, tiny_model_dir, "cpu", None, torch.bfloat16)
    assert uses_upcast(ref) and not uses_upcast(
        reference_model(plain, tiny_model_dir, "cpu", None, torch.bfloat16)
    )
    want = logprobs(fp32)
    gap_plain = float((logprobs(plain).float() - want).abs().max())
    gap_routed = float((logprobs(routed).float() - want).abs().max())
    assert 0 < gap_routed <= 1.5 * gap_plain + 1e-3
    assert torch.equal(logprobs(ref), logprobs(routed))  # k3 KL exactly 0 before the first step
    m = ppo_update(routed, make_optimizer(routed.parameters(), torch.bfloat16, lr=1e-3, weight_decay=0.0), batch,
                   PPOConfig(kl_coef=0.05), ref_model=ref)  # fmt: skip
    assert m["kl"] == 0.0 and m["grad_norm"] > 0
