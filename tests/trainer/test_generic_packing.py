"""Packed rows on the transformers path (`train.pack_rows`, trainer/forward.py's
`generic_selected_logprobs`): for every model type `packing_refusal` allows, tiny random models drawn by
transformers give the padded forward's logprobs, entropies and gradients packed (Gemma's sliding window
biting, rows of very different lengths sharing a prefix, a row with nothing selected), and each row's
own full forward; Qwen3.5's linear-attention layers would carry one row's state into the next, so its
rows stay padded under `auto` and `on` is refused, naming the model type and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from harnessrl.modeling.hf_generic import PACKED_MODEL_TYPES, GenericCausalLM, load_generic
from harnessrl.trainer.forward import Selected, selected_logprobs
from harnessrl.trainer.moe_aux import aux_pack_rows, check_moe_aux
from harnessrl.trainer.packing import check_pack_rows, plan_rows, use_generic_packing
from tests.support.families import have_tokenizer, tiny_family_dir
from tests.support.generic_families import generic_dir
from tests.trainer.test_packing import LENGTHS, assert_same, mixed_rows

pytest.importorskip("transformers")

# name -> (tokenizer family, drawn by): the builtin families' tiny folders forced onto transformers' path,
# and the architectures only transformers implements
MODELS = {
    "llama3": "builtin",
    "qwen2_5": "builtin",
    "qwen3": "builtin",
    "gemma3": "builtin",
    "qwen3_moe": "generic",
    "gemma4": "generic",
}
TOKENIZER = {"qwen3_moe": "qwen3", "gemma4": "gemma3", "qwen3_5": "qwen3"}
needs_tokenizers = pytest.mark.skipif(
    not all(have_tokenizer(TOKENIZER.get(n, n)) for n in [*MODELS, "qwen3_5"]),
    reason="real tokenizers missing: run make install",
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("generic-packing")


def load(name: str, root: Path) -> GenericCausalLM:
    """The tiny `name` model on the transformers path."""
    folder = tiny_family_dir(name, root) if MODELS.get(name) == "builtin" else generic_dir(name)
    return load_generic(folder)


def record_positions(model: GenericCausalLM, monkeypatch: pytest.MonkeyPatch) -> list[Tensor | None]:
    """The `position_ids` of every decoder call (None: the padded rows), so a test sees packing ran."""
    seen: list[Tensor | None] = []
    original = model.hidden_states

    def recorded(input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None):
        seen.append(position_ids)
        return original(input_ids, attention_mask, position_ids)

    monkeypatch.setattr(model, "hidden_states", recorded)
    return seen


def forward_backward(
    model: Any, batch: tuple[Tensor, Tensor, Tensor], pack: str, checkpoint: bool | None = None
) -> tuple[Selected, dict[str, Tensor]]:
    """(Selected, gradients by name) of a weighted sum of the selected logprobs."""
    tokens, select, temps = batch
    model.zero_grad(set_to_none=True)
    sel = selected_logprobs(
        model, tokens, select, temps, 11, entropy=True, checkpoint_layers=checkpoint, pack=pack
    )
    (sel.logprobs * torch.linspace(-1.0, 1.0, len(sel.logprobs))).sum().backward()
    return sel, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@needs_tokenizers
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_rows_equal_padded_rows(root: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logprobs, entropies and every parameter's gradient, packed against padded; then every packed logprob
    against the model's forward of that row alone."""
    model = load(name, root)
    assert model.config.model_type in PACKED_MODEL_TYPES
    batch = mixed_rows(model.config.vocab_size, 11, seed=len(name))
    padded = forward_backward(model, batch, "off")
    seen = record_positions(model, monkeypatch)
    packed = forward_backward(model, batch, "on")
    lengths = plan_rows(batch[1], 0).lengths  # rows cut at their last selected token; the last row: none
    assert len(seen) == 1 and seen[0] is not None
    want = torch.cat([torch.arange(n) for n in lengths if n])
    assert torch.equal(seen[0][0], want)
    assert padded[0].logprobs.std() > 0.5  # far from uniform: a row seeing another's tokens would show
    assert_same(padded, packed)
    with torch.no_grad():
        for b, n in enumerate(LENGTHS[:3]):
            ids = batch[0][b : b + 1, :n]
            alone = model.logits(model.hidden_states(ids)).float()
            lp = torch.log_softmax(alone[0, :-1] / batch[2][b], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            mine = packed[0].row == b
            torch.testing.assert_close(
                packed[0].logprobs[mine].detach(), lp[packed[0].pos[mine]], rtol=0, atol=1e-4
            )


@needs_tokenizers
def test_packed_rows_under_layer_checkpointing(root: Path) -> None:
    """transformers' gradient checkpointing recomputes the packed layers with their positions: the same
    gradients as the padded rows without it (an MoE: every token routed on its own)."""
    model = load("qwen3_moe", root).train()
    batch = mixed_rows(model.config.vocab_size, 11, seed=3)
    padded = forward_backward(model, batch, "off", checkpoint=False)
    packed = forward_backward(model, batch, "on", checkpoint=True)
    assert model.model.is_gradient_checkpointing
    assert_same(padded, packed)


@needs_tokenizers
def test_linear_attention_rows_are_not_packed(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5's Gated DeltaNet layers run their conv and recurrence over the whole time axis on CPU: rows
    packed back to back would leak (shown here), so `auto` keeps them padded and `on` is refused at the
    trainer's load and in the forward, naming the model type and the field."""
    model = load("qwen3_5", root)
    assert model.config.hybrid and model.config.model_type == "qwen3_5_text"
    rows = [torch.randint(3, 20000, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 12, 20)]
    with torch.no_grad():
        alone = [model.hidden_states(r.unsqueeze(0))[0] for r in rows]
        at = torch.cat([torch.arange(len(r)) for r in rows]).unsqueeze(0)
        together = model.hidden_states(torch.cat(rows).unsqueeze(0), position_ids=at)[0]
    gaps = [float((a - b).abs().max()) for a, b in zip(alone, together.split([30, 12, 20]), strict=True)]
    assert gaps[0] < 1e-4 and min(gaps[1:]) > 0.1  # the first row alone is unaffected; the others are not

    batch = mixed_rows(model.config.vocab_size, 11, seed=2)
    with pytest.raises(
        ValueError, match=r"train\.pack_rows: on: model type 'qwen3_5_text' has linear-attention"
    ):
        selected_logprobs(model, *batch, 11, pack="on")
    with pytest.raises(ValueError, match=r"train\.pack_rows: on: model type 'qwen3_5_text'"):
        check_pack_rows(model, "on")
    check_pack_rows(model, "auto")
    seen = record_positions(model, monkeypatch)
    with torch.no_grad():
        auto = selected_logprobs(model, *batch, 11, pack="auto")
        off = selected_logprobs(model, *batch, 11, pack="off")
    assert seen == [None, None]
    assert torch.equal(auto.logprobs, off.logprobs)


def test_auto_weighs_the_masked_attention_of_packed_rows() -> None:
    """`auto` packs where the positions saved outweigh the packed rows' N² attention scores (transformers'
    one masked call) against the padded rows' causal B · width² / 2; a refused model never packs."""
    select = torch.zeros(4, 1999, dtype=torch.bool)
    for b, n in enumerate((2000, 300, 800, 150)):
        select[b, : n - 1] = True
    skewed = plan_rows(select, 0)
    # (FLOPs per token, per score): SmolLM2-135M's shape (106 M weights outside the embedding; 30 layers
    # of 9 heads of 64) and a 7B's (6.5 G; 32 layers of 32 heads of 128)
    small, large = (2 * 106_000_000, 4 * 64 * 9 * 30), (2 * 6_500_000_000, 4 * 128 * 32 * 32)
    assert use_generic_packing("auto", skewed, 2000, None, small)
    select = torch.zeros(16, 499, dtype=torch.bool)
    for b in range(16):
        select[b, : 300 + 12 * b] = True  # 300 .. 480 tokens: 25% padding, but 16 rows' N² scores
    many = plan_rows(select, 0)
    assert not use_generic_packing("auto", many, 500, None, small)  # a small model: attention dominates
    assert use_generic_packing("auto", many, 500, None, large)  # a wide one: the projections do
    assert use_generic_packing("on", many, 500, None, small)
    assert not use_generic_packing("off", skewed, 2000, None, small)
    assert not use_generic_packing("auto", skewed, 2000, "why", small)
    with pytest.raises(ValueError, match=r"train\.pack_rows: on: why; set train\.pack_rows: auto"):
        use_generic_packing("on", skewed, 2000, "why", small)
    with pytest.raises(ValueError, match=r"train\.pack_rows must be one of"):
        use_generic_packing("yes", skewed, 2000, "why", small)


@needs_tokenizers
def test_the_moe_router_loss_keeps_rows_padded(root: Path) -> None:
    """With `train.moe_aux_loss_coef` > 0 the router loss covers the padded rows' real tokens: `auto` runs
    padded and `on` is refused (at load too)."""
    assert aux_pack_rows("on", 0.0) == "on" and aux_pack_rows("auto", 0.1) == "off"
    with pytest.raises(ValueError, match=r"train\.pack_rows: on with train\.moe_aux_loss_coef"):
        aux_pack_rows("on", 0.1)
    model = load("qwen3_moe", root)
    check_moe_aux(model, 0.1, "auto")
    with pytest.raises(ValueError, match=r"train\.pack_rows: on with train\.moe_aux_loss_coef"):
        check_moe_aux(model, 0.1, "on")
