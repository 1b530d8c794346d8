"""train.dtype bfloat16: exact fp32 master weights split into a bf16 half and an int16 low half, AdamW on
them equal to fp32 AdamW bit for bit, the KL reference in bf16 (k3 exactly 0 before the first step), and
the engine/trainer gap reported per update so a precision mismatch shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, Row
from harnessrl.config import ConfigError, load_config
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.packed import use_onednn_for_training
from harnessrl.modeling.reference import reference_model
from harnessrl.modeling.upcast import install_upcast, needs_upcast, uses_upcast
from harnessrl.trainer import precision
from harnessrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from harnessrl.trainer.distributed import optimizer_spec, rank_optimizer
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


def _steps(
    opt: torch.optim.Optimizer, p: torch.nn.Parameter, grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Step `opt` once per gradient; the fp32 master weights before the first step and after each."""
    out = [master_weights(opt, p).clone()]
    for grad in grads:
        p.grad = grad.clone() if p.dtype == torch.bfloat16 else grad.float()
        opt.step()
        out.append(master_weights(opt, p).clone())
    return out


def _grads(shape: tuple[int, int], n: int, seed: int) -> list[torch.Tensor]:
    """bf16 gradients with a steady part per weight and noise (a first moment that is neither 0 nor g)."""
    g = torch.Generator().manual_seed(seed)
    steady = torch.randn(shape, generator=g)
    return [(steady + torch.randn(shape, generator=g)).bfloat16() for _ in range(n)]


def test_bf16_exp_avg_is_adamw_with_exp_avg_rounded_to_bf16_after_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reference: fp32 AdamW on the master weights whose exp_avg is rounded to the nearest bf16 after
    every step, bit for bit (the parameter stepped in several chunks)."""
    monkeypatch.setattr(precision, "CHUNK", 1000)  # 48 x 64: 4 chunks, the last one short
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    grads = _grads((48, 64), 8, seed=5)
    p32 = torch.nn.Parameter(w.float())
    ref = torch.optim.AdamW([p32], lr=3e-3, weight_decay=0.1)
    p16 = torch.nn.Parameter(w.clone())
    opt = make_optimizer([p16], torch.bfloat16, lr=3e-3, weight_decay=0.1, exp_avg_dtype="bfloat16")
    for grad in grads:
        p32.grad, p16.grad = grad.float(), grad.clone()
        ref.step()
        ref.state[p32]["exp_avg"].copy_(ref.state[p32]["exp_avg"].bfloat16())
        opt.step()
        st = opt.state[p16]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(st["exp_avg"].float(), ref.state[p32]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], ref.state[p32]["exp_avg_sq"])
        assert torch.equal(master_weights(opt, p16), p32.detach())


def test_bf16_exp_avg_updates_stay_within_a_percent_of_the_exact_ones() -> None:
    """30 AdamW steps from the same weights with the same gradients: float32 (the default) is bit for bit
    fp32 AdamW; with a bf16 first moment each step's update (after − before, weight decay included) is
    within 1 % of the exact one in L2 (measured: 0.34 %; the worst case, every rounding adding up, is
    2^-8 / (1 − β1) ≈ 3.9 %), and the weights after all steps within 1 % of the whole way they moved."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads = _grads((96, 64), 30, seed=7)
    p32 = torch.nn.Parameter(w.float())
    exact = _steps(torch.optim.AdamW([p32], lr=1e-3, weight_decay=0.01), p32, grads)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    fp32 = _steps(MasterAdamW([a], lr=1e-3, weight_decay=0.01, exp_avg_dtype="float32"), a, grads)
    bf16 = _steps(MasterAdamW([b], lr=1e-3, weight_decay=0.01, exp_avg_dtype="bfloat16"), b, grads)
    assert all(torch.equal(x, y) for x, y in zip(fp32, exact, strict=True))
    errors = []
    for t in range(1, len(exact)):
        want, got = exact[t] - exact[t - 1], bf16[t] - bf16[t - 1]
        errors.append(float((got - want).norm() / want.norm()))
    assert 0 < max(errors) <= 0.01
    assert float((bf16[-1] - exact[-1]).norm() / (exact[-1] - exact[0]).norm()) <= 0.01


def test_bf16_exp_avg_survives_a_checkpoint_and_a_switch_of_dtype(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """save_checkpoint/load_checkpoint keep a bf16 exp_avg bf16 (and the next update equals the
    uninterrupted one bit for bit); a resume that switches train.exp_avg_dtype converts the saved moment."""
    batches = [random_batch(6, seed=s) for s in (21, 22)]
    cfg = PPOConfig(micro_batch_tokens=256)

    def trainer(exp_avg_dtype: str) -> tuple[CausalLM, torch.optim.Optimizer]:
        model = load_model(tiny_model_dir, dtype=torch.bfloat16)
        return model, make_optimizer(model.parameters(), torch.bfloat16, 1e-3, 0.01, exp_avg_dtype)

    model, opt = trainer("bfloat16")
    ppo_update(model, opt, batches[0], cfg)
    save_checkpoint(tmp_path, 1, model, opt, {})
    saved = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    ppo_update(model, opt, batches[1], cfg)
    straight = {n: master_weights(opt, p) for n, p in model.named_parameters()}

    model2, opt2 = trainer("bfloat16")
    load_checkpoint(tmp_path / "step-1", model2, opt2)
    for n, p in model2.named_parameters():
        st = opt2.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.float32
        assert st[LOW_KEY].dtype == torch.int16 and torch.equal(st["exp_avg"], saved[n])
    ppo_update(model2, opt2, batches[1], cfg)
    for n, p in model2.named_parameters():
        assert torch.equal(master_weights(opt2, p), straight[n]), n

    model3, opt3 = trainer("float32")  # switched at the resume: the bf16 moment widened exactly
    load_checkpoint(tmp_path / "step-1", model3, opt3)
    for n, p in model3.named_parameters():
        assert opt3.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt3.state[p]["exp_avg"], saved[n].float())


def test_bf16_exp_avg_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match=r"train\.exp_avg_dtype"):
        make_optimizer([torch.nn.Parameter(torch.zeros(3))], torch.float32, 1e-3, 0.0, "bfloat16")
    with pytest.raises(ValueError, match=r"train\.exp_avg_dtype"):
        MasterAdamW([torch.nn.Parameter(torch.zeros(3).bfloat16())], exp_avg_dtype="float16")


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["train.exp_avg_dtype=bfloat16"], "train.dtype"),
        (["train.dtype=bfloat16", "train.exp_avg_dtype=bfloat16", "train.world_size=2", "train.parallel=fsdp"],
         "train.parallel"),
        (["train.dtype=bfloat16", "train.exp_avg_dtype=bfloat16", "train.lora={}"], "train.lora"),
        (["train.dtype=bfloat16", "train.exp_avg_dtype=float16"], "exp_avg_dtype"),
    ],
)  # fmt: skip
def test_config_refuses_a_bf16_exp_avg_where_it_cannot_apply(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names) as err:
        load_config(None, overrides)
    assert "exp_avg_dtype" in str(err.value)
    cfg = load_config(None, ["train.dtype=bfloat16", "train.exp_avg_dtype=bfloat16", "train.world_size=2"])
    assert cfg.train.exp_avg_dtype == "bfloat16" and load_config(None, []).train.exp_avg_dtype == "float32"


def test_a_data_parallel_rank_builds_rank_0s_optimizer() -> None:
    """The options a rank's MasterAdamW gets from rank 0's spec: all of them, the bf16 first moment too
    (the options of a `**kwargs` constructor were dropped, so a rank stepped with AdamW's default decay)."""
    params = [torch.nn.Parameter(torch.zeros(4).bfloat16())]
    opt = MasterAdamW(
        params, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, exp_avg_dtype="bfloat16"
    )
    spec = json.loads(json.dumps(optimizer_spec(opt)))  # as it travels to a rank started apart
    rank = rank_optimizer(spec, [torch.nn.Parameter(torch.zeros(4).bfloat16())])
    assert isinstance(rank, MasterAdamW) and rank.exp_avg_dtype == "bfloat16"
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert rank.param_groups[0][key] == opt.param_groups[0][key], key


def test_stochastic_split_is_exact_and_unbiased() -> None:
    """Each draw is the bf16 just below or just above the master (in magnitude) with the exact fp32 kept
    in an int32 low half; over many draws the mean is the master: nearest's is not."""
    x = torch.randn(2_000, generator=torch.Generator().manual_seed(30)) * torch.logspace(-20, 20, 2_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    down = (x.view(torch.int32).to(torch.int64) >> 16 << 16).to(torch.int32).view(torch.float32)  # truncated
    gen = torch.Generator().manual_seed(31)
    total = torch.zeros_like(x, dtype=torch.float64)
    draws = 400
    for _ in range(draws):
        high, low = precision.split_master_stochastic(x, gen)
        assert high.dtype == torch.bfloat16 and low.dtype == torch.int32
        assert torch.equal(join_master(high, low).view(torch.int32), x.view(torch.int32))
        h = high.float()
        ulp = (down.abs() * 2**-7).clamp_min(1e-45)
        assert bool(((h == down) | ((h - down).abs() <= ulp * 1.0001)).all())
        total += h.double()
    mean = total / draws
    err = ((mean - x.double()) / x.double().abs().clamp_min(1e-30))[:2_000]
    # a draw's error is at most 2^-7 relative, 400 draws: the mean's error ~ 2^-8 / 20 at most
    assert float(err.abs().mean()) < 2**-8 / 10
    nearest = ((split_master(x)[0].double() - x.double()) / x.double().abs().clamp_min(1e-30))[:2_000]
    assert float(err.abs().mean()) < float(nearest.abs().mean()) / 3


def test_stochastic_rounding_keeps_the_masters_and_moves_the_weights_with_them() -> None:
    """Same gradients: the masters are bit for bit nearest's (the rounding only chooses the bf16 half).
    At a small learning rate nearest leaves most bf16 weights where they started; stochastic moves them
    as the masters moved, in the mean (with rounding noise: per weight, a cosine to the masters' move is
    lower than nearest's)."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(32)).bfloat16()
    grads = _grads((64, 64), 5, seed=33)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    near = MasterAdamW([a], lr=2e-4, weight_decay=0.0)
    stoch = MasterAdamW([b], lr=2e-4, weight_decay=0.0, rounding="stochastic", seed=1)
    masters_a, masters_b = _steps(near, a, grads), _steps(stoch, b, grads)
    assert all(torch.equal(x, y) for x, y in zip(masters_a, masters_b, strict=True))
    assert stoch.state[b][LOW_KEY].dtype == torch.int32 and near.state[a][LOW_KEY].dtype == torch.int16
    moved = masters_a[-1] - w.float()  # the same for both
    seen_near, seen_stoch = a.detach().float() - w.float(), b.detach().float() - w.float()
    assert float((a != w).float().mean()) < 0.5  # most of nearest's weights have not moved yet
    # in the mean over weights moving the same way, stochastic's visible move matches the masters'
    up = moved > 0
    assert abs(float(seen_stoch[up].mean() / moved[up].mean()) - 1) < 0.15
    assert float(seen_near[up].mean() / moved[up].mean()) < 0.85


def test_stochastic_draws_depend_on_seed_and_step_only() -> None:
    """Two optimizers with one seed (two DDP ranks, or a run and its resume) round alike; another seed
    rounds otherwise; the rounding and seed reach a rank through optimizer_spec."""
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(34)).bfloat16()
    grads = _grads((32, 32), 3, seed=35)
    weights = []
    for seed in (7, 7, 8):
        p = torch.nn.Parameter(w.clone())
        _steps(MasterAdamW([p], lr=1e-3, weight_decay=0.0, rounding="stochastic", seed=seed), p, grads)
        weights.append(p.detach().clone())
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    opt = MasterAdamW([torch.nn.Parameter(w.clone())], rounding="stochastic", seed=7)
    rank = rank_optimizer(json.loads(json.dumps(optimizer_spec(opt))), [torch.nn.Parameter(w.clone())])
    assert isinstance(rank, MasterAdamW) and (rank.rounding, rank.seed) == ("stochastic", 7)


def test_a_stochastic_checkpoint_resumes_under_nearest(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A checkpoint of a stochastic run loaded with bf16_rounding nearest: the masters unchanged, the bf16
    weights their nearest rounding, the low halves int16 again."""
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    opt = make_optimizer(model.parameters(), torch.bfloat16, 1e-3, 0.01, rounding="stochastic", seed=3)
    ppo_update(model, opt, random_batch(6, seed=36), PPOConfig(micro_batch_tokens=256))
    save_checkpoint(tmp_path, 1, model, opt, {})
    masters = {n: master_weights(opt, p) for n, p in model.named_parameters()}
    model2 = load_model(tiny_model_dir, dtype=torch.bfloat16)
    opt2 = make_optimizer(model2.parameters(), torch.bfloat16, 1e-3, 0.01)
    load_checkpoint(tmp_path / "step-1", model2, opt2)
    for n, p in model2.named_parameters():
        assert opt2.state[p][LOW_KEY].dtype == torch.int16
        assert torch.equal(master_weights(opt2, p), masters[n]), n
        assert torch.equal(p.detach(), split_master(masters[n])[0]), n


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["train.bf16_rounding=stochastic"], "train.dtype"),
        (["train.dtype=bfloat16", "train.bf16_rounding=stochastic", "train.world_size=2", "train.parallel=fsdp"],
         "train.parallel"),
        (["train.dtype=bfloat16", "train.bf16_rounding=stochastic", "train.lora={}"], "train.lora"),
        (["train.dtype=bfloat16", "train.bf16_rounding=up"], "bf16_rounding"),
    ],
)  # fmt: skip
def test_config_refuses_stochastic_rounding_where_it_cannot_apply(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names) as err:
        load_config(None, overrides)
    assert "bf16_rounding" in str(err.value)
    cfg = load_config(None, ["train.dtype=bfloat16", "train.bf16_rounding=stochastic", "train.world_size=2"])
    assert cfg.train.bf16_rounding == "stochastic" and load_config(None, []).train.bf16_rounding == "nearest"
    with pytest.raises(ValueError, match=r"train\.bf16_rounding"):
        make_optimizer([torch.nn.Parameter(torch.zeros(3))], torch.float32, 1e-3, 0.0, rounding="stochastic")
