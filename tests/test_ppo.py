"""The PPO-clip update: the per-token loss against its formula, and the same gradient whether the
batch is split into one micro-batch or many."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, LossMode, Row, loss_weights
from harnessrl.modeling.loading import load_model
from harnessrl.trainer.ppo import PPOConfig, micro_batch_loss, micro_batches, ppo_token_loss, ppo_update


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


def test_micro_batches_respect_the_budget_and_cover_every_row() -> None:
    lengths = [random.Random(i).randint(1, 300) for i in range(50)]
    groups = micro_batches(lengths, 600)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 600


def random_batch(n_rows: int, seed: int) -> Batch:
    rnd = random.Random(seed)
    rows = []
    for i in range(n_rows):
        n = rnd.randint(8, 40)
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append(Row(f"r{i % 3}", [rnd.randint(3, 49000) for _ in range(n)], mask,
                        [rnd.uniform(-6, -0.1) * m for m in mask], temperature=rnd.choice([1.0, 0.7])))  # fmt: skip
    return Batch(rows, [rnd.uniform(-1, 1) for _ in rows], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})


def grads(model: torch.nn.Module, batch: Batch, budget: int) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    cfg = PPOConfig(micro_batch_tokens=budget)
    total = 0.0
    for idx in micro_batches([len(r.tokens) for r in batch.rows], budget):
        loss, _ = micro_batch_loss(model, batch, idx, cfg)  # type: ignore[arg-type]
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradient_is_the_same_for_one_or_many_micro_batches(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(9, seed=1)
    loss_one, g_one = grads(model, batch, budget=10**6)
    loss_many, g_many = grads(model, batch, budget=45)  # about one row per micro-batch
    assert len(micro_batches([len(r.tokens) for r in batch.rows], 45)) >= 7
    assert loss_many == pytest.approx(loss_one, rel=1e-5, abs=1e-7)
    for a, b in zip(g_one, g_many, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_update_moves_the_policy_toward_positive_advantage(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(4, seed=2)
    batch.advantages = [1.0, 1.0, 1.0, 1.0]
    from harnessrl.modeling.logprobs import next_token_logprobs

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
