"""LoRA (modeling/lora.py): merged and unmerged forwards agree, only the adapter trains, the oneDNN
training path gives the adapter the same gradient, and the PEFT export loads in peft with the
trainer's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model, load_weights_into
from harnessrl.modeling.lora import (
    LoraAdapter,
    LoraSpec,
    attach,
    merged_state,
    read_peft,
    save_peft,
)
from harnessrl.modeling.packed import onednn_available, use_onednn_for_training
from harnessrl.modeling.reference import reference_model

IDS = torch.tensor([[1, 4093, 198, 2683, 314, 253, 1345, 28, 906, 30, 4093, 198, 7, 11]])


def _adapted(
    model_dir: Path, spec: LoraSpec = LoraSpec(), seed: int = 3
) -> tuple[LlamaForCausalLM, LoraAdapter]:
    """The tiny model with an adapter whose B is random (a fresh adapter is the identity)."""
    model = load_model(model_dir)
    adapter = attach(model, spec, seed=seed, base_model=str(model_dir))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.lora_B:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model, adapter


def test_fresh_adapter_is_the_identity(engine_tiny_dir: Path) -> None:
    base = load_model(engine_tiny_dir)
    model = load_model(engine_tiny_dir)
    attach(model, LoraSpec(r=4))
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS))


def test_merged_and_unmerged_forward_agree(engine_tiny_dir: Path) -> None:
    model, adapter = _adapted(engine_tiny_dir)
    merged = load_model(engine_tiny_dir)
    load_weights_into(merged, merged_state(model, adapter))
    with torch.no_grad():
        unmerged_logits, merged_logits = model(IDS), merged(IDS)
        base_logits = load_model(engine_tiny_dir)(IDS)
    assert (unmerged_logits - base_logits).abs().max() > 1e-3  # the adapter does change the outputs
    assert (unmerged_logits - merged_logits).abs().max() < 1e-5
    adapter.enabled = False
    with torch.no_grad():
        assert torch.equal(model(IDS), base_logits)


def test_targets_by_name_and_refusals(engine_tiny_dir: Path) -> None:
    model = load_model(engine_tiny_dir)
    adapter = attach(model, LoraSpec(target_modules=("q_proj", "down_proj")))
    layers = model.config.num_hidden_layers
    assert sorted(adapter.names) == sorted(
        [f"model.layers.{i}.self_attn.q_proj" for i in range(layers)]
        + [f"model.layers.{i}.mlp.down_proj" for i in range(layers)]
    )
    with pytest.raises(ValueError, match="match no linear layer"):
        attach(load_model(engine_tiny_dir), LoraSpec(target_modules=("qkv",)))
    with pytest.raises(ValueError, match="token embedding"):  # SmolLM2's lm_head is its embedding
        attach(load_model(engine_tiny_dir), LoraSpec(target_modules=("lm_head",)))


def test_only_the_adapter_trains(engine_tiny_dir: Path) -> None:
    model, adapter = _adapted(engine_tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(p.requires_grad for p in model.parameters())
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        torch.log_softmax(model(IDS), -1)[0, :-1].gather(-1, IDS[0, 1:, None]).sum().backward()
        optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert sum(len(s) for s in optimizer.state.values()) == 3 * len(list(adapter.parameters()))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_training_path_gives_the_adapter_the_same_gradient(engine_tiny_dir: Path) -> None:
    grads = []
    for matmul in ("aten", "onednn"):
        model, adapter = _adapted(engine_tiny_dir)
        use_onednn_for_training(model, matmul, torch.device("cpu"))
        torch.log_softmax(model(IDS), -1)[0, :-1].gather(-1, IDS[0, 1:, None]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_peft_loads_the_export_with_the_trainers_logits(engine_tiny_dir: Path, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    spec = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    model, adapter = _adapted(engine_tiny_dir, spec)
    out = save_peft(adapter, tmp_path / "adapter", str(engine_tiny_dir), version=3)
    assert read_peft(out)[0] == LoraSpec(4, 8.0, 0.0, tuple(sorted(spec.target_modules)))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(engine_tiny_dir), torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS).logits
        ours = model(IDS)
    assert (ours - load_model(engine_tiny_dir)(IDS)).abs().max() > 1e-3
    assert (theirs - ours).abs().max() < 1e-4


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_reference_under_lora_is_the_base_without_a_copy(engine_tiny_dir: Path) -> None:
    model, adapter = _adapted(engine_tiny_dir)
    use_onednn_for_training(model, "onednn", torch.device("cpu"))
    ref = reference_model(model, engine_tiny_dir, "cpu", adapter)
    assert {p.data_ptr() for p in ref.parameters()} == {p.data_ptr() for p in model.parameters()}
    with torch.no_grad():
        base, policy, reference = load_model(engine_tiny_dir)(IDS), model(IDS), ref(IDS)
    assert (policy - base).abs().max() > 1e-3
    assert (reference - base).abs().max() < 1e-5  # the oneDNN path rounds differently from F.linear
    assert adapter.enabled and not any(p.requires_grad for p in ref.parameters())


@pytest.mark.parametrize(
    ("field", "value"),
    [("rank_pattern", {"q_proj": 2}), ("alpha_pattern", {"v_proj": 4}), ("layers_to_transform", [0]),
     ("modules_to_save", ["lm_head"]), ("fan_in_fan_out", True), ("lora_bias", True), ("bias", "all"),
     ("use_rslora", True)],
)  # fmt: skip
def test_read_peft_refuses_what_it_does_not_apply(
    engine_tiny_dir: Path, tmp_path: Path, field: str, value: object
) -> None:
    """A config PEFT itself writes (peft.LoraConfig.save_pretrained) with one field set that a merge with
    one global r and alpha would ignore is refused, naming that field; the plain one is read."""
    peft = pytest.importorskip("peft")
    spec = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    _, adapter = _adapted(engine_tiny_dir, spec)
    out = save_peft(adapter, tmp_path / "adapter", str(engine_tiny_dir))
    plain = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    peft.LoraConfig(**plain).save_pretrained(str(out))
    assert read_peft(out)[0].r == 4
    peft.LoraConfig(**plain, **{field: value}).save_pretrained(str(out))
    with pytest.raises(ValueError, match=f"sets {field}="):
        read_peft(out)
