"""Memory savings that must not change the numbers (issue 23): the chunked, checkpointed logprob head and
checkpointed layers give the trainer's logprobs and gradients of the plain forward; an update gives its
gradients back and holds no packed copies; the engine's packed copies are its only copy of the linear weights and
still serve state dict, weight loads and sleep."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import harnessrl.trainer.forward as forward_mod
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model, load_state_dict_file, save_model
from harnessrl.modeling.packed import (
    PackedLinears,
    _TrainPackedForward,
    onednn_available,
    use_onednn_for_training,
)
from harnessrl.trainer.ppo import PPOConfig, _pack, micro_batch_loss, ppo_update
from tests.trainer.test_ppo import random_batch

IDS = torch.tensor([[1, 4093, 198, 504, 2210, 30, 12, 777, 9001, 44]])
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _loss_and_grads(
    model: LlamaForCausalLM, checkpoint_layers: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    batch = random_batch(9, seed=5)
    model.zero_grad(set_to_none=True)
    loss, stats, new_lp = micro_batch_loss(model, batch, list(range(9)), PPOConfig(), None, None,
                                           checkpoint_layers)  # fmt: skip
    loss.backward()
    assert stats["entropy_sum"] > 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), new_lp, grads


def test_chunked_head_and_checkpointed_layers_keep_logprobs_and_gradients(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(tiny_model_dir)
    loss, lp, grads = _loss_and_grads(model)  # the whole head in one chunk: nothing recomputed
    n_tokens = lp.numel()
    monkeypatch.setattr(forward_mod, "LOGIT_CHUNK_ELEMENTS", model.config.vocab_size * 24)
    assert n_tokens > 48  # several chunks of 24 positions, each recomputed in the backward pass
    for checkpoint_layers in (False, True):
        loss2, lp2, grads2 = _loss_and_grads(model, checkpoint_layers)
        torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-8)
        assert grads2.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(grads2[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_chunked_entropy_and_no_grad_path(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_model_dir)
    batch = random_batch(6, seed=2)
    p = _pack(batch, list(range(6)), torch.device("cpu"))
    with torch.no_grad():
        whole = forward_mod.selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix, entropy=True)
        monkeypatch.setattr(forward_mod, "LOGIT_CHUNK_ELEMENTS", model.config.vocab_size * 3)
        parts = forward_mod.selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix, entropy=True)
    assert whole.entropy is not None and parts.entropy is not None
    torch.testing.assert_close(parts.logprobs, whole.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(parts.entropy, whole.entropy, rtol=1e-6, atol=1e-6)
    assert bool((whole.entropy > 0).all())


@needs_onednn
def test_update_gives_back_gradients_and_packed_copies(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert use_onednn_for_training(model, "onednn", torch.device("cpu")) == "onednn (asked)"
    packs = [
        lin.forward for lin in model.modules() if isinstance(lin.__dict__.get("forward"), _TrainPackedForward)
    ]
    assert packs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    m = ppo_update(model, opt, random_batch(9, seed=7), PPOConfig(), checkpoint_layers=True)
    assert m["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it stepped
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.state) == len(before)  # the optimizer state (needed) stays
    assert not [v for f in packs for v in vars(f).values() if isinstance(v, torch.Tensor)]  # no copies held
    with torch.no_grad():  # the next forward uses the stepped weights, not a copy of the old ones
        through_onednn = model(IDS)
        for lin in model.modules():
            if isinstance(lin, torch.nn.Linear):
                lin.__dict__.pop("forward", None)
        through_aten = model(IDS)
    torch.testing.assert_close(through_onednn, through_aten, rtol=0, atol=1e-3)


def _engine_model(path: Path) -> LlamaForCausalLM:
    model = load_model(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


@needs_onednn
def test_engine_packs_are_the_only_copy_and_serve_state_dict_and_loads(
    engine_tiny_dir: Path, tmp_path: Path
) -> None:
    model = _engine_model(engine_tiny_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    packed = PackedLinears(model)
    packed.refresh()
    with torch.inference_mode():
        logits = model(IDS)
    freed = packed.release_originals()
    linear_bytes = sum(
        p.numel() * 4 for n, p in original.items() if n.startswith("model.layers.") and "proj" in n
    )
    assert freed == linear_bytes and packed.released
    assert "lm_head.weight" not in packed.released  # it is the token embedding too: kept
    with torch.inference_mode():
        assert torch.equal(model(IDS), logits)  # served from the packed copies alone
    with pytest.raises(RuntimeError, match="only in its packed copy"):
        packed.refresh()
    for name, tensor in packed.state_dict().items():
        assert torch.equal(tensor, original[name]), name  # unpacking is exact
    other = _engine_model(engine_tiny_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_model(other, tmp_path / "v1")
    packed.load(load_state_dict_file(tmp_path / "v1"))
    new_state = packed.state_dict()
    for name, tensor in other.state_dict().items():
        assert torch.equal(new_state[name], tensor), name
    plain = PackedLinears(other)
    plain.refresh()
    with torch.inference_mode():
        assert torch.equal(model(IDS), other(IDS))  # the same packed products as a fresh model's
    packed.drop()  # sleep level 2: the released weights are gone until the next load
    packed.load(load_state_dict_file(tmp_path / "v1"))
    with torch.inference_mode():
        assert torch.equal(model(IDS), other(IDS))
