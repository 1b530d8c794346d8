"""The PPO-clip update: the per-token loss against its formula, and the same gradient whether the
batch is split into one micro-batch or many."""

from __future__ import annotations

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
            part, _ = micro_batch_loss(model, batch, idx, cfg)  # type: ignore[arg-type]
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
