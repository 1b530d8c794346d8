"""A resumed run's next update equals the uninterrupted run's: model, optimizer moments, LR schedule
and RNG all come back from the checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from harnessrl.modeling.loading import load_model
from harnessrl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from harnessrl.trainer.ppo import PPOConfig, lr_lambda, ppo_update
from tests.trainer.test_ppo import random_batch


def _trainer(
    model_dir: Path,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = load_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", 1, 4, 0.1))
    return model, opt, sched


def test_resumed_update_equals_the_uninterrupted_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = PPOConfig(micro_batch_tokens=256, tis_cap=2.0)
    batches = [random_batch(6, seed=s) for s in (11, 12, 13)]

    model, opt, sched = _trainer(tiny_model_dir)
    ppo_update(model, opt, batches[0], cfg, scheduler=sched)  # type: ignore[arg-type]
    ppo_update(model, opt, batches[1], cfg, scheduler=sched)  # type: ignore[arg-type]
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    save_checkpoint(tmp_path, 2, model, opt, {"next_group": 9, "pending_groups": [6, 8]}, sched)  # type: ignore[arg-type]
    draws = (torch.rand(3), random.random(), np.random.rand())
    m_straight = ppo_update(model, opt, batches[2], cfg, scheduler=sched)  # type: ignore[arg-type]
    straight = {k: v.detach().clone() for k, v in model.state_dict().items()}

    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # a new process: other RNG states
    model2, opt2, sched2 = _trainer(tiny_model_dir)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    state = load_checkpoint(ckpt, model2, opt2, sched2)  # type: ignore[arg-type]
    assert state == {"step": 2, "next_group": 9, "pending_groups": [6, 8]}
    assert sched2.last_epoch == 2
    resumed_draws = (torch.rand(3), random.random(), np.random.rand())
    torch.testing.assert_close(draws[0], resumed_draws[0])
    assert draws[1:] == resumed_draws[1:]
    m_resumed = ppo_update(model2, opt2, batches[2], cfg, scheduler=sched2)  # type: ignore[arg-type]
    assert m_resumed["lr"] == m_straight["lr"] and m_resumed["loss"] == m_straight["loss"]
    for name, value in model2.state_dict().items():
        torch.testing.assert_close(value, straight[name], rtol=0, atol=1e-6, msg=name)
    assert sched2.get_last_lr() == sched.get_last_lr()
