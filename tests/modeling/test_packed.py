"""oneDNN-packed linear layers (modeling/packed.py): same results within the exactness bound, repacked
when the weights change, dropped cleanly, and `auto` falls back to F.linear when its probe rejects."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

import harnessrl.modeling.packed as packed_mod
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.lora import LoraSpec, attach
from harnessrl.modeling.lora_swap import Adapter, LoraSwap, adapter_terms
from harnessrl.modeling.packed import PackedLinears, choose_matmul, onednn_available, use_onednn_for_training
from harnessrl.modeling.upcast import needs_upcast

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")

IDS = torch.tensor([[1, 4093, 198, 504, 2210, 30, 12, 777, 9001, 44]])


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS)[0]


def _model(engine_tiny_dir: Path) -> LlamaForCausalLM:
    model = load_model(engine_tiny_dir)
    with torch.no_grad():  # larger logits than the init's near-zero ones, so a difference would show
        model.lm_head.weight.mul_(40.0)
    return model


def test_packed_layers_match_f_linear_and_drop_restores_it(engine_tiny_dir: Path) -> None:
    model = _model(engine_tiny_dir)
    plain = _logits(model)
    packed = PackedLinears(model)
    packed.refresh()
    layer = model.model.layers[0]
    assert packed.active and layer.self_attn.fused_qkv is not None and layer.mlp.fused_gate_up is not None
    fast = _logits(model)
    assert (torch.log_softmax(fast, -1) - torch.log_softmax(plain, -1)).abs().max() < 1e-4
    packed.drop()
    assert layer.self_attn.fused_qkv is None and layer.mlp.fused_gate_up is None
    assert torch.equal(_logits(model), plain)  # back on F.linear, bit for bit


def test_refresh_follows_new_weights(engine_tiny_dir: Path) -> None:
    model = _model(engine_tiny_dir)
    packed = PackedLinears(model)
    packed.refresh()
    before = _logits(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # packed alone
        model.model.layers[1].self_attn.v_proj.weight.mul_(3.0)  # inside the fused q/k/v product
    stale = _logits(model)
    assert torch.equal(stale, before)  # the packed copy does not see an in-place change...
    packed.refresh()
    fresh = _logits(model)
    packed.drop()
    want = _logits(model)  # F.linear with the new weights
    assert not torch.allclose(fresh, before, atol=1e-3)
    assert (
        torch.log_softmax(fresh, -1) - torch.log_softmax(want, -1)
    ).abs().max() < 1e-4  # ...a refresh does


def test_choose_matmul_modes(engine_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(engine_tiny_dir)
    cpu = torch.device("cpu")
    assert choose_matmul(model, "aten", cpu) == (None, "aten (asked)")
    packed, why = choose_matmul(model, "auto", cpu)
    assert packed is not None and packed.active and why.startswith("onednn (probe gap")
    packed.drop()
    plain = _logits(model)
    monkeypatch.setattr(packed_mod, "PROBE_BOUND", -1.0)  # a probe that rejects everything
    packed, why = choose_matmul(model, "auto", cpu)
    assert packed is None and why.startswith("aten (oneDNN probe gap")
    assert torch.equal(_logits(model), plain)  # nothing left installed
    packed, why = choose_matmul(model, "onednn", cpu)  # asked for: no probe
    assert packed is not None and why == "onednn (asked)"
    packed.drop()
    with pytest.raises(ValueError, match="needs a CPU engine"):
        choose_matmul(model, "onednn", torch.device("cuda"))
    assert choose_matmul(model, "auto", torch.device("cuda"))[0] is None
    bf16 = load_model(engine_tiny_dir, dtype=torch.bfloat16)
    assert choose_matmul(bf16, "auto", cpu)[1].startswith("aten (auto packs float32")


def test_engine_reports_its_matmul_path(engine_server: object) -> None:
    stats = httpx.get(engine_server.url + "/admin/stats").json()  # type: ignore[attr-defined]
    assert stats["matmul"].startswith("onednn (probe gap")


def _loss(model: LlamaForCausalLM) -> torch.Tensor:
    logp = torch.log_softmax(model(IDS)[0, :-1].float(), -1)
    return -logp.gather(-1, IDS[0, 1:].unsqueeze(-1)).mean()


def test_training_through_onednn_matches_f_linear_and_follows_each_step(engine_tiny_dir: Path) -> None:
    plain, fast = _model(engine_tiny_dir), _model(engine_tiny_dir)
    why = use_onednn_for_training(fast, "auto", torch.device("cpu"))
    assert why.startswith("onednn (probe gap")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, fast)]
    for step in range(3):  # the packed copies must follow every optimizer step
        losses = []
        for m, opt in zip((plain, fast), opts, strict=True):
            opt.zero_grad()
            loss = _loss(m)
            loss.backward()
            losses.append(loss)
            if step < 2:
                opt.step()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in fast.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-3, atol=1e-6, msg=n)
    assert not torch.equal(plain.lm_head.weight, _model(engine_tiny_dir).lm_head.weight)  # it did train
    bf16 = load_model(engine_tiny_dir, dtype=torch.bfloat16)
    # bf16: never oneDNN; fp32 products where this CPU has no fast bf16 ones (modeling/upcast.py)
    want = "fp32 products" if needs_upcast(torch.bfloat16, torch.device("cpu")) else "aten (auto uses oneDNN"
    assert use_onednn_for_training(bf16, "auto", torch.device("cpu")).startswith(want)
    assert use_onednn_for_training(plain, "aten", torch.device("cpu")) == "aten (aten asked)"


def _adapter(model_dir: Path, seed: int, targets: tuple[str, ...]) -> tuple[LlamaForCausalLM, Adapter]:
    """A trainer-side model with a trained-like adapter (random B) on `targets`, and its PEFT tensors."""
    model = _model(model_dir)
    lora = attach(model, LoraSpec(r=2, target_modules=targets), seed=seed)
    with torch.no_grad():
        for b in lora.lora_B:
            b.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return model, (lora.spec, {k: v.detach().clone() for k, v in lora.peft_tensors().items()})


def test_lora_swap_serves_the_adapter_unmerged_without_touching_packed_weights(engine_tiny_dir: Path) -> None:
    """An engine-like model (packed, originals released) swaps adapters: the packed weights stay the same
    tensors (nothing unpacked or repacked), the products of untargeted layers get no term, and the
    logprobs follow the trainer's (adapter hooks) each time."""
    served = _model(engine_tiny_dir)
    packed = PackedLinears(served)
    packed.refresh()
    packed.release_originals()
    layer = served.model.layers[0]
    weights = [
        layer.self_attn.fused_qkv.packed,
        layer.mlp.fused_gate_up.packed,
        layer.mlp.down_proj.forward.packed,
    ]
    shapes = {k: v.shape for k, v in served.state_dict(keep_vars=True).items()}
    old = None
    for seed in (1, 2):  # the second swap replaces the first adapter
        trainer, new = _adapter(engine_tiny_dir, seed, ("q_proj", "down_proj"))
        swap = LoraSwap(new, old)
        swap.check(shapes)
        terms = {n: t for n, t in adapter_terms(swap.new).items() if n in packed.lora_names()}
        assert len(terms) == 2 * len(served.model.layers)
        assert packed.set_lora(terms) == 2 * len(served.model.layers)  # fused q/k/v and down, per layer
        assert layer.mlp.fused_gate_up.lora is None and layer.self_attn.fused_qkv.lora is not None
        now = [
            layer.self_attn.fused_qkv.packed,
            layer.mlp.fused_gate_up.packed,
            layer.mlp.down_proj.forward.packed,
        ]
        assert all(a is b for a, b in zip(now, weights, strict=True))
        want = torch.log_softmax(_logits(trainer), -1)
        assert (torch.log_softmax(_logits(served), -1) - want).abs().max() < 1e-4
        old = new
    assert packed.set_lora({}) == 0 and layer.self_attn.fused_qkv.lora is None  # back to the base
    with pytest.raises(ValueError, match=r"lora_B \(64, 2\) @ lora_A"):
        bad = {k: v[:, :1] if k.endswith("lora_A.weight") else v for k, v in new[1].items()}
        LoraSwap((new[0], bad), None).check(shapes)
