"""Packed rows in the trainer's forward (trainer/packing.py): logprobs, entropies and gradients of the
packed forward equal the padded forward's on a tiny real model of every builtin family (Gemma 3's
sliding window biting, a shared prefix, rows of very different lengths, a row with nothing selected),
and each row run alone through the model's full forward; when `auto` packs; the CUDA varlen call's
layout against the kernel's documented semantics (the kernel itself needs a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from harnessrl.modeling.loading import load_model
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.modeling.transformer import Attention, ModelConfig
from harnessrl.trainer import packing
from harnessrl.trainer.forward import Selected, selected_logprobs
from harnessrl.trainer.packing import RowAttention, plan_rows, use_packing
from tests.support.families import FAMILIES, have_tokenizer, tiny_family_dir

# Packed and padded sum in different orders (the products' blocking changes with the position count):
# measured up to 2e-5 on logprobs of ~-12 (fp32) and 1e-6 of a gradient's largest entry.
LOGPROB_TOL = 1e-4
GRAD_REL_TOL = 1e-5

families = pytest.mark.skipif(
    not all(have_tokenizer(f) for f in FAMILIES), reason="real tokenizers missing: run make install"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("packing")


LENGTHS = [90, 16, 40, 28]


def mixed_rows(vocab: int, prefix: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded tokens [4, 90] of rows 90, 16, 40 and 28 tokens long sharing their first `prefix`
    tokens, the positions selected (some rows end on unselected tokens; the last row has none), temps."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    select = torch.zeros(len(LENGTHS), max(LENGTHS) - 1, dtype=torch.bool)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    for b, n in enumerate(LENGTHS):
        tokens[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        tokens[b, :prefix] = shared
        first = max(prefix, 1)
        select[b, first : n - 1] = torch.rand(n - 1 - first, generator=g) < 0.6
    select[0, -6:] = False  # the longest row's last tokens are not trained: not run packed
    select[3] = False  # nothing selected: not run packed
    return tokens, select, torch.tensor([1.0, 0.7, 1.3, 1.0])


def forward_backward(model: Any, tokens: Tensor, select: Tensor, temps: Tensor, prefix: int, pack: str):
    """(Selected, gradients by name) of a weighted sum of the selected logprobs."""
    model.zero_grad(set_to_none=True)
    sel = selected_logprobs(model, tokens, select, temps, prefix, entropy=True, pack=pack)
    weights = torch.linspace(-1.0, 1.0, len(sel.logprobs))
    (sel.logprobs * weights).sum().backward()
    return sel, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def count_packed_attention(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the packed rows' attention, counted (so a test sees that packing ran)."""
    calls: list[int] = []
    original = RowAttention.attend

    def counted(self: RowAttention, *args: Any) -> Tensor:
        calls.append(len(self.lengths))
        return original(self, *args)

    monkeypatch.setattr(RowAttention, "attend", counted)
    return calls


def assert_same(padded: tuple[Selected, dict[str, Tensor]], packed: tuple[Selected, dict[str, Tensor]]):
    (a, ga), (b, gb) = padded, packed
    assert torch.equal(a.row, b.row) and torch.equal(a.pos, b.pos)
    assert a.entropy is not None and b.entropy is not None
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=LOGPROB_TOL)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=LOGPROB_TOL)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name, g in ga.items():
        scale = float(g.abs().max())
        assert scale > 0, name
        assert float((gb[name] - g).abs().max()) <= GRAD_REL_TOL * scale, name


@families
@pytest.mark.parametrize("prefix", [0, 11])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_padded_rows(
    root: Path, family: str, prefix: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logprobs, entropies and every parameter's gradient; Gemma 3's window (16 keys) bites in 90-token
    rows, and with a prefix the rows' keys start with the prefix's."""
    model = load_model(tiny_family_dir(family, root))
    tokens, select, temps = mixed_rows(model.config.vocab_size, prefix, seed=len(family) + prefix)
    padded = forward_backward(model, tokens, select, temps, prefix, "off")
    calls = count_packed_attention(monkeypatch)
    packed = forward_backward(model, tokens, select, temps, prefix, "on")
    assert calls == [3] * model.config.num_hidden_layers  # 3 rows with selected tokens, each layer
    assert padded[0].logprobs.std() > 0.5  # logprobs far from uniform: a wrong piece would show
    assert_same(padded, packed)


@families
@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_packed_rows_equal_each_row_alone(root: Path, family: str) -> None:
    """Every packed logprob is the one the model's full forward of that row alone gives."""
    model = load_model(tiny_family_dir(family, root))
    prefix = 11
    tokens, select, temps = mixed_rows(model.config.vocab_size, prefix, seed=5)
    with torch.no_grad():
        sel = selected_logprobs(model, tokens, select, temps, prefix, pack="on")
        for b, n in enumerate(LENGTHS):
            ids = tokens[b : b + 1, :n]
            full = next_token_logprobs(model(ids), ids, float(temps[b]))[0]
            mine = sel.row == b
            assert int(mine.sum()) == int(select[b].sum())
            torch.testing.assert_close(sel.logprobs[mine], full[sel.pos[mine]], rtol=0, atol=LOGPROB_TOL)


def test_auto_packs_rows_of_different_lengths_only(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` packs when over 10% of the padded positions would be padding; the padded rows' own
    (batched) attention otherwise."""
    select = torch.zeros(3, 99, dtype=torch.bool)
    select[:, 4:98] = True
    even = plan_rows(select, 4)
    assert even.lengths == [94, 94, 94] and not use_packing("auto", even, 95)
    select[1, 40:] = False
    select[2, 10:] = False
    skewed = plan_rows(select, 4)
    assert skewed.lengths == [94, 36, 6] and skewed.starts == [0, 94, 130]
    assert use_packing("auto", skewed, 95) and not use_packing("off", skewed, 95)
    assert use_packing("on", even, 95)
    with pytest.raises(ValueError, match=r"train\.pack_rows"):
        use_packing("yes", even, 95)

    model = load_model(tiny_model_dir)
    tokens = torch.randint(3, 1000, (3, 100), generator=torch.Generator().manual_seed(0))
    tokens[:, :4] = tokens[0, :4]
    calls = count_packed_attention(monkeypatch)
    with torch.no_grad():
        selected_logprobs(model, tokens, select, torch.ones(3), 4)
        assert len(calls) == model.config.num_hidden_layers
        select[:, 4:98] = True
        selected_logprobs(model, tokens, select, torch.ones(3), 4)
    assert len(calls) == model.config.num_hidden_layers  # equal rows: padded


def flash_semantics(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, *,
    scale: float | None, window_size: tuple[int, int], enable_gqa: bool,
) -> Tensor:  # fmt: skip
    """varlen_attn as its docstring defines it: rows cut at cu_q/cu_k ([T, heads, head_dim]); query i of a
    row of sq queries and sk keys sits at key position i + sk - sq, and sees keys within (left, right)
    of it (-1: unbounded)."""
    left, right = window_size
    outs = []
    for r in range(len(cu_q) - 1):
        qs, ks = q[cu_q[r] : cu_q[r + 1]], k[cu_k[r] : cu_k[r + 1]]
        vs = v[cu_k[r] : cu_k[r + 1]]
        sq, sk = qs.shape[0], ks.shape[0]
        assert sq <= max_q and sk <= max_k
        at = torch.arange(sq).unsqueeze(1) + sk - sq
        keys = torch.arange(sk).unsqueeze(0)
        allowed = (keys <= at + right) if right >= 0 else torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            allowed &= keys >= at - left
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1),
            ks.transpose(0, 1),
            vs.transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("prefix", [0, 7])
def test_varlen_call_attends_as_the_per_row_path(
    window: int | None, prefix: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one varlen call of CUDA bf16 (offsets, the prefix's keys before each row's, the window as
    flash's (left, right)) attends as the per-row SDPA path, with the kernel replaced by its documented
    semantics: this checks our call, not the kernel (which has not run here: no GPU)."""
    cfg = ModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      sliding_window=window, layer_types=("sliding_attention" if window else "full_attention",),
                      num_hidden_layers=1)  # fmt: skip
    attn = Attention(cfg, cfg.kind(0))
    select = torch.zeros(3, 29, dtype=torch.bool)
    for b, end in enumerate((29, 9, 18)):
        select[b, prefix:end] = True
    plan = plan_rows(select, prefix)
    view = RowAttention.build(plan, attn.window, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    n = plan.total
    q, k, v = (
        torch.randn(1, 4, n, 8, generator=g),
        torch.randn(1, 2, n, 8, generator=g),
        torch.randn(1, 2, n, 8, generator=g),
    )
    kp = torch.randn(1, 2, prefix, 8, generator=g) if prefix else None
    vp = torch.randn(1, 2, prefix, 8, generator=g) if prefix else None
    want = view.attend(attn, q, k, v, kp, vp)
    monkeypatch.setattr(packing, "_varlen_attn", lambda: flash_semantics)
    got = view._varlen(attn, q, k, v, kp, vp)
    assert got.shape == want.shape == (1, 4, n, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
