"""Per-token advantages (step credit) in the PPO loss: the loss against its formula with a full forward
of each row, the scalar case unchanged, and rows whose only signal is a turn-level term still run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, LossMode, Row, loss_weights
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.trainer.ppo import PPOConfig, micro_batch_loss, ppo_token_loss, rows_to_run


def batch_with_two_calls(seed: int) -> Batch:
    """Rows of two completions each (prompt c0 observation c1), random old logprobs."""
    rnd = random.Random(seed)
    rows = []
    for i in range(4):
        parts = [rnd.randint(3, 49000) for _ in range(rnd.randint(3, 8))]
        c0 = [rnd.randint(3, 49000) for _ in range(rnd.randint(1, 6))]
        obs = [rnd.randint(3, 49000) for _ in range(rnd.randint(1, 4))]
        c1 = [rnd.randint(3, 49000) for _ in range(rnd.randint(1, 6))]
        mask = [0] * len(parts) + [1] * len(c0) + [0] * len(obs) + [1] * len(c1)
        rows.append(Row(f"r{i}", parts + c0 + obs + c1, mask, [rnd.uniform(-5, -0.1) * m for m in mask], 1.0))
    return Batch(
        rows, [rnd.uniform(-1, 1) for _ in rows], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {}
    )


def reference_loss(model: torch.nn.Module, batch: Batch, cfg: PPOConfig) -> float:
    """Σ_rows Σ_t w_t ℓ_t(A_t) with each row's full forward and each token's own advantage."""
    assert batch.token_advantages is not None
    total = 0.0
    with torch.no_grad():
        for row, adv, w in zip(batch.rows, batch.token_advantages, batch.weights, strict=True):
            ids = torch.tensor([row.tokens])
            new = next_token_logprobs(model(ids), ids, row.temperature)[0]
            loss_t = ppo_token_loss(new, torch.tensor(row.old_logprobs[1:]), torch.tensor(adv[1:]),
                                    cfg.clip_low, cfg.clip_high)  # fmt: skip
            total += float((loss_t * torch.tensor(w[1:])).sum())
    return total


def test_token_advantages_enter_the_loss_token_by_token(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    cfg = PPOConfig()
    batch = batch_with_two_calls(seed=4)
    rnd = random.Random(5)
    batch.token_advantages = [[a + rnd.choice([-0.7, 0.0, 0.4]) * m for m in r.loss_mask]
                              for r, a in zip(batch.rows, batch.advantages, strict=True)]  # fmt: skip
    with torch.no_grad():
        loss, stats, _ = micro_batch_loss(model, batch, list(range(4)), cfg)  # type: ignore[arg-type]
    assert float(loss) == pytest.approx(reference_loss(model, batch, cfg), rel=1e-5, abs=1e-7)
    assert stats["tokens"] == sum(r.n_trainable for r in batch.rows)


def test_equal_token_advantages_give_the_scalar_loss(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    cfg = PPOConfig()
    batch = batch_with_two_calls(seed=6)
    with torch.no_grad():
        scalar, _, _ = micro_batch_loss(model, batch, list(range(4)), cfg)  # type: ignore[arg-type]
        batch.token_advantages = [
            [a] * len(r.tokens) for r, a in zip(batch.rows, batch.advantages, strict=True)
        ]
        per_token, _, _ = micro_batch_loss(model, batch, list(range(4)), cfg)  # type: ignore[arg-type]
    assert float(per_token) == pytest.approx(float(scalar), rel=1e-6, abs=1e-8)


def test_rows_with_only_a_turn_level_term_are_run() -> None:
    batch = batch_with_two_calls(seed=7)
    batch.advantages = [0.0, 0.0, 0.5, 0.0]
    assert rows_to_run(batch, PPOConfig()) == [2]
    batch.token_advantages = [[0.0] * len(r.tokens) for r in batch.rows]
    first_sampled = batch.rows[1].loss_mask.index(1)
    batch.token_advantages[1][first_sampled] = 0.3  # a credited call in an otherwise flat rollout
    batch.token_advantages[3][0] = 0.3  # a prompt token (loss mask 0): no signal
    assert rows_to_run(batch, PPOConfig()) == [1]


def test_the_run_config_chooses_the_estimator() -> None:
    """`train.credit` and `train.step_coef` reach the batch the loop trains on; the default is unchanged."""
    from types import SimpleNamespace

    from harnessrl.config import RunConfig
    from harnessrl.schema import StepReward
    from harnessrl.trainer.loop import batch_metrics, make_batch
    from tests.adapter.test_step_credit import detail

    details = [
        detail("a", 1.0, [StepReward(call=0, value=1.0)]),
        detail("b", 0.0, [StepReward(call=0, value=0.0)]),
    ]
    default = make_batch(SimpleNamespace(cfg=RunConfig()), details)  # type: ignore[arg-type]
    assert default.token_advantages is None and "step_rewards" not in batch_metrics(default, [])
    cfg = RunConfig.model_validate({"train": {"credit": "step", "step_coef": 0.5, "estimator": "dr_grpo"}})
    step = make_batch(SimpleNamespace(cfg=cfg), details)  # type: ignore[arg-type]
    assert step.token_advantages is not None
    assert step.token_advantages[0][3:5] == pytest.approx([0.5 + 0.25] * 2)  # A = 0.5, β (1 − 0.5) = 0.25
    metrics = batch_metrics(step, [])
    assert metrics["step_rewards"]["step_rewards"] == 2 and metrics["rollouts_flagged_hacking"] == 0
    with pytest.raises(ValueError, match="advantage_level: rollout"):
        RunConfig.model_validate({"train": {"credit": "step", "advantage_level": "sample"}})
