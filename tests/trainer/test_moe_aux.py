"""`train.moe_aux_loss_coef` (trainer/moe_aux.py) on a tiny random Qwen3-MoE drawn by transformers: the
aux term equals transformers' own `aux_loss`, a nonzero coefficient adds exactly c·Σw·∇aux to the
update's gradient, and 0 leaves the RL gradient as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.adapter import Batch, Row, loss_weights
from harnessrl.adapter.loss_weights import LossMode
from harnessrl.modeling.loading import load_model
from harnessrl.trainer.moe_aux import check_moe_aux, router_aux
from harnessrl.trainer.ppo import PPOConfig, micro_batch_loss
from tests.support.generic_families import generic_dir

pytest.importorskip("transformers")


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, n in enumerate((14, 10)):
        tokens = torch.randint(3, 5000, (n,), generator=gen).tolist()
        mask = [0] * 6 + [1] * (n - 6)
        rows.append(Row(f"g{i}", tokens, mask, [-3.0 * m for m in mask], 1.0))
    return Batch(rows, [1.0, -0.5], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})


def _gate_grads(model: torch.nn.Module, batch: Batch, coef: float) -> tuple[torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    loss, _, _ = micro_batch_loss(model, batch, [0, 1], PPOConfig(moe_aux_loss_coef=coef))  # type: ignore[arg-type]
    loss.backward()
    grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert grads and all(g is not None for g in grads)
    return torch.cat([g.flatten() for g in grads]), float(loss)


def test_moe_aux_loss_matches_transformers_and_enters_the_gradient_only_when_set() -> None:
    model = load_model(generic_dir("qwen3_moe"))
    batch = _batch()
    tokens = torch.tensor([batch.rows[0].tokens, batch.rows[1].tokens + [0] * 4])  # right-padded
    with torch.no_grad(), router_aux(model, 1.0, [14, 10]) as aux:
        model.hidden_states(tokens)
        mask = torch.tensor([[1] * 14, [1] * 10 + [0] * 4])
        theirs = model.full(input_ids=tokens, attention_mask=mask, output_router_logits=True).aux_loss
    assert float(aux.loss(torch.tensor(1.0))) == pytest.approx(float(theirs), rel=1e-5)

    g0, loss0 = _gate_grads(model, batch, 0.0)
    g1, loss1 = _gate_grads(model, batch, 0.5)
    g2, _ = _gate_grads(model, batch, 1.0)
    assert loss1 != loss0 and not torch.allclose(g1, g0)
    torch.testing.assert_close(g2 - g0, 2 * (g1 - g0), rtol=1e-4, atol=1e-7)  # linear in c
    with router_aux(model, 0.0, [14, 10]) as off:  # 0: no hooks, no term
        model.hidden_states(torch.tensor([batch.rows[0].tokens]))
    assert off.logits == [] and off.loss(torch.tensor(1.0)) == 0.0


def test_a_nonzero_coefficient_on_a_dense_model_is_a_clear_error(tiny_model_dir: Path) -> None:
    builtin, dense = load_model(tiny_model_dir), load_model(generic_dir("qwen3_5"))
    for model in (builtin, dense):
        with pytest.raises(ValueError, match="moe_aux_loss_coef"):
            check_moe_aux(model, 0.1)  # as the trainer loads the policy
        check_moe_aux(model, 0.0)
    with pytest.raises(ValueError, match="moe_aux_loss_coef"), router_aux(builtin, 0.1, [4]):
        pass
    check_moe_aux(load_model(generic_dir("qwen3_moe")), 0.1)
