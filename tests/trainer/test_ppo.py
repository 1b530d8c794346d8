"""The PPO-clip update: the per-token loss against its formula, and the same gradient whether the
batch is split into one micro-batch or many."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, LossMode, Row, loss_weights
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.trainer.forward import selected_logprobs, shareable_prefix
from harnessrl.trainer.ppo import (
    PPOConfig,
    _pack,
    first_trainable,
    micro_batch_loss,
    micro_batches,
    ppo_token_loss,
    ppo_update,
)


def test_token_loss_matches_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(200, generator=g) * 0.3, torch.randn(200, generator=g) * 0.3
    adv = torch.randn(200, generator=g)
    got = ppo_token_loss(new, old, adv, 0.2, 0.28)
    for i in range(200):
        ratio = float(torch.exp(new[i] - old[i]))
        a = float(adv[i])
        want = -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
        assert float(got[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_micro_batches_cover_every_row_and_respect_the_budget() -> None:
    rnd = random.Random(0)
    shared = [rnd.randint(3, 900) for _ in range(50)]
    rows = [
        shared[: rnd.randint(0, 50)] + [rnd.randint(3, 900) for _ in range(rnd.randint(1, 200))]
        for _ in range(60)
    ]
    first = [len(r) // 2 for r in rows]
    groups = micro_batches(rows, first, 600)
    assert sorted(i for g in groups for i in g) == list(range(60))
    for g in groups:
        p = shareable_prefix([rows[i] for i in g], [first[i] for i in g])
        assert len(g) == 1 or p + len(g) * (max(len(rows[i]) for i in g) - p) <= 600


def random_batch(n_rows: int, seed: int) -> Batch:
    """Rows like a real step's: a shared system prefix, siblings sharing their whole prompt."""
    rnd = random.Random(seed)
    system = [rnd.randint(3, 49000) for _ in range(12)]
    rows = []
    for i in range(n_rows):
        if i % 3 == 0:
            prompt = system + [rnd.randint(3, 49000) for _ in range(rnd.randint(2, 10))]
        completion = [rnd.randint(3, 49000) for _ in range(rnd.randint(1, 12))]
        obs = [rnd.randint(3, 49000) for _ in range(rnd.randint(0, 5))]
        second = [rnd.randint(3, 49000) for _ in range(rnd.randint(0, 6))]
        tokens = prompt + completion + obs + second
        mask = [0] * len(prompt) + [1] * len(completion) + [0] * len(obs) + [1] * len(second)
        rows.append(Row(f"r{i // 3}", tokens, mask, [rnd.uniform(-6, -0.1) * m for m in mask],
                        temperature=1.0 if i % 2 else 0.7))  # fmt: skip
    return Batch(
        rows, [rnd.uniform(-1, 1) for _ in rows], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {}
    )


def reference_loss(model: torch.nn.Module, batch: Batch, cfg: PPOConfig) -> torch.Tensor:
    """The loss straight from the formula: a full forward of each row alone, every position."""
    total = torch.zeros(())
    for row, adv, w in zip(batch.rows, batch.advantages, batch.weights, strict=True):
        ids = torch.tensor([row.tokens])
        new = next_token_logprobs(model(ids), ids, row.temperature)[0]
        old = torch.tensor(row.old_logprobs[1:])
        loss_t = ppo_token_loss(new, old, torch.tensor(adv), cfg.clip_low, cfg.clip_high)
        total = total + (loss_t * torch.tensor(w[1:])).sum()
    return total


def grads(model: torch.nn.Module, batch: Batch, budget: int | None) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    cfg = PPOConfig(micro_batch_tokens=budget or 1)
    if budget is None:
        loss = reference_loss(model, batch, cfg)
        loss.backward()
        total = float(loss.detach())
    else:
        total = 0.0
        firsts = [first_trainable(r.loss_mask) for r in batch.rows]
        for idx in micro_batches([r.tokens for r in batch.rows], firsts, budget):
            part, _, _ = micro_batch_loss(model, batch, idx, cfg)  # type: ignore[arg-type]
            part.backward()
            total += float(part.detach())
    return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradient_equals_the_formula_for_one_or_many_micro_batches(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(12, seed=1)
    loss_ref, g_ref = grads(model, batch, budget=None)
    loss_one, g_one = grads(model, batch, budget=10**6)  # one micro-batch, shared prefix
    loss_many, g_many = grads(model, batch, budget=30)  # about one row per micro-batch
    firsts = [first_trainable(r.loss_mask) for r in batch.rows]
    assert len(micro_batches([r.tokens for r in batch.rows], firsts, 10**6)) == 1
    assert len(micro_batches([r.tokens for r in batch.rows], firsts, 30)) >= 8
    for loss, g in ((loss_one, g_one), (loss_many, g_many)):
        assert loss == pytest.approx(loss_ref, rel=1e-5, abs=1e-7)
        for a, b in zip(g_ref, g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_selected_logprobs_equal_a_full_forward(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(6, seed=3)
    packed = _pack(batch, list(range(6)), torch.device("cpu"))
    assert packed.prefix >= 12  # the system prompt is shared
    with torch.no_grad():
        sel = selected_logprobs(model, packed.tokens, packed.select, packed.temps, packed.prefix)
        for lp, r, t in zip(sel.logprobs, sel.row, sel.pos, strict=True):
            row = batch.rows[int(r)]
            ids = torch.tensor([row.tokens])
            full = next_token_logprobs(model(ids), ids, row.temperature)[0]
            assert float(lp) == pytest.approx(float(full[int(t)]), abs=1e-5)
    assert len(sel.logprobs) == sum(r.n_trainable for r in batch.rows)


def test_update_moves_the_policy_toward_positive_advantage(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(4, seed=2)
    batch.advantages = [1.0, 1.0, 1.0, 1.0]

    def mean_lp() -> float:
        with torch.no_grad():
            vals = []
            for r in batch.rows:
                ids = torch.tensor([r.tokens])
                lp = next_token_logprobs(model(ids), ids, r.temperature)[0]
                vals += [float(x) for x, m in zip(lp, r.loss_mask[1:], strict=True) if m]
            return sum(vals) / len(vals)

    before = mean_lp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        m = ppo_update(model, opt, batch, PPOConfig(clip_low=10.0, clip_high=10.0))
    assert m["grad_norm"] > 0 and mean_lp() > before


def reference_terms(
    model: torch.nn.Module, batch: Batch
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per row: (new logprobs, full tempered log-distribution, trainable-token mask) from a full forward."""
    from harnessrl.modeling.logprobs import tempered_log_softmax

    out = []
    for row in batch.rows:
        ids = torch.tensor([row.tokens])
        logits = model(ids)[0, :-1]
        full = tempered_log_softmax(logits, row.temperature)
        new = full.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        out.append((new, full, torch.tensor(row.loss_mask[1:], dtype=torch.bool)))
    return out


def test_tis_loss_and_gradient_match_the_formula(tiny_model_dir: Path) -> None:
    """Epoch 1 with a TIS cap: ρ = 1 against the proximal (current) policy, so the loss value is
    −Σ w ι A and the gradient is −Σ w ι A ∇π, with ι = min(exp(π − μ), C)."""
    model = load_model(tiny_model_dir)
    batch = random_batch(6, seed=5)
    cap = 1e-3  # the tiny random model's π ≈ −10.8 against μ in [−6, −0.1]: ι spans 2e-5..8e-3
    cfg = PPOConfig(micro_batch_tokens=10**6, tis_cap=cap)
    model.zero_grad(set_to_none=True)
    loss, stats, _ = micro_batch_loss(model, batch, list(range(6)), cfg)  # type: ignore[arg-type]
    loss.backward()
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    ref = torch.zeros(())
    truncated = 0
    for (new, _, mask), row, adv, w in zip(
        reference_terms(model, batch), batch.rows, batch.advantages, batch.weights, strict=True
    ):
        mu = torch.tensor(row.old_logprobs[1:])
        iota = torch.clamp(torch.exp(new.detach() - mu), max=cap)
        truncated += int(((iota >= cap) & mask).sum())
        ref = ref + (-(iota * adv * torch.exp(new - new.detach())) * torch.tensor(w[1:]) * mask).sum()
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-9)
    assert stats["tis_truncated"] == truncated and 0 < truncated < stats["tokens"]
    for a, b in zip(got, [p.grad for p in model.parameters() if p.grad is not None], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)


def test_kl_penalty_and_entropy_match_full_forwards(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    ref_model = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    batch = random_batch(5, seed=6)
    idx = list(range(5))
    plain, stats0, _ = micro_batch_loss(model, batch, idx, PPOConfig())  # type: ignore[arg-type]
    with_kl, stats, _ = micro_batch_loss(model, batch, idx, PPOConfig(kl_coef=0.5), ref_model=ref_model)  # type: ignore[arg-type]
    want_kl, want_ent, n = 0.0, 0.0, 0
    with torch.no_grad():
        for (new, full, mask), (ref_new, _, _), w in zip(
            reference_terms(model, batch), reference_terms(ref_model, batch), batch.weights, strict=True
        ):
            d = ref_new - new
            k3 = torch.exp(d) - d - 1
            want_kl += float((k3 * torch.tensor(w[1:]) * mask).sum())
            want_ent += float((-(full.exp() * full).sum(-1) * mask).sum())
            n += int(mask.sum())
    assert float((with_kl - plain).detach()) == pytest.approx(0.5 * want_kl, rel=1e-4)
    assert want_kl > 0 and stats["kl_sum"] > 0 and stats0["kl_sum"] == 0.0
    assert stats["entropy_sum"] / stats["tokens"] == pytest.approx(want_ent / n, rel=1e-5)
    with pytest.raises(ValueError, match="reference model"):
        micro_batch_loss(model, batch, idx, PPOConfig(kl_coef=0.1))  # type: ignore[arg-type]


def test_a_second_epoch_clips_against_the_proximal_policy(tiny_model_dir: Path) -> None:
    """With a TIS cap and 2 epochs, the second epoch's ratio is π_new / π_epoch1, not π / μ."""
    model = load_model(tiny_model_dir)
    batch = random_batch(4, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no movement: the proximal ratio stays 1
    m = ppo_update(model, opt, batch, PPOConfig(tis_cap=5.0, epochs=2))
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["clip_frac"] == 0.0
    m_plain = ppo_update(model, opt, batch, PPOConfig(epochs=2))  # against μ: random, far from 1
    assert abs(m_plain["ratio_mean"] - 1.0) > 0.1


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule(schedule: str) -> None:
    from harnessrl.trainer.ppo import lr_lambda

    f = lr_lambda(schedule, warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [f(n) for n in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    tail = [f(n) for n in range(4, 20)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(tail))  # never increases
    if schedule == "constant":
        assert tail == [1.0] * len(tail)
    else:
        assert f(14) == pytest.approx(0.1) and f(19) == pytest.approx(0.1)
        assert f(9) == pytest.approx(0.55)  # the midpoint of both decays
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_lambda("step", 0, 10)


def test_zero_advantage_rows_are_skipped_without_changing_the_update(tiny_model_dir: Path) -> None:
    """Rows with advantage 0 add no gradient (no KL term): the update skips them, and the step equals
    the one computed over every row."""
    batch = random_batch(8, seed=5)
    batch.advantages = [0.0, 1.5, 0.0, -0.7, 0.0, 0.0, 2.0, 0.0]
    cfg = PPOConfig(max_grad_norm=1e9)
    ref = load_model(tiny_model_dir)
    ref.train()
    every_row = list(range(8))
    loss, _, _ = micro_batch_loss(ref, batch, every_row, cfg)
    loss.backward()
    expected = {n: p.detach() - 1e-2 * p.grad for n, p in ref.named_parameters() if p.grad is not None}

    model = load_model(tiny_model_dir)
    m = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1e-2), batch, cfg)
    assert m["skipped_zero_adv_rows"] == 5 and m["loss"] != 0.0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-5, atol=1e-7)

    batch.advantages = [0.0] * 8  # nothing to learn: no step at all
    before = [p.detach().clone() for p in model.parameters()]
    m = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1e-2), batch, cfg)
    assert m["skipped_zero_adv_rows"] == 8 and m["grad_norm"] == 0.0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


def test_gpu_suffix_bias_attends_as_the_cpu_mask() -> None:
    """The lower-right causal bias the trainer gives SDPA on a GPU (no mask matrix: fast kernels) attends
    exactly as the boolean suffix mask used on CPU (checked here on CPU, where both run)."""
    from torch.nn.attention.bias import causal_lower_right

    from harnessrl.modeling.transformer import window_mask
    from harnessrl.trainer.forward import suffix_mask

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 4, 9, 8, generator=g)
    pos = torch.arange(4, 9)
    mask = suffix_mask(pos, 9, None)  # CPU: the boolean mask, as before
    assert mask.dtype == torch.bool and torch.equal(mask, window_mask(pos, 9, None))
    fast = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=causal_lower_right(5, 9))
    assert torch.equal(fast, torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask))
