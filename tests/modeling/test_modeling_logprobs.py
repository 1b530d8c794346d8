"""THE logprob definition: log_softmax(logits / T) gathered at the tokens, greedy reported at T = 1."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.modeling.logprobs import next_token_logprobs, tempered_log_softmax, token_logprobs


def test_matches_the_formula() -> None:
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([0, 3, 6])
    for t in (1.0, 0.7, 1.3):
        ref = torch.log_softmax(logits / t, -1)[torch.arange(3), tokens]
        assert torch.allclose(token_logprobs(logits, tokens, t), ref)


def test_greedy_reports_temperature_one() -> None:
    logits = torch.randn(2, 5)
    tokens = torch.tensor([1, 2])
    assert torch.equal(token_logprobs(logits, tokens, 0.0), token_logprobs(logits, tokens, 1.0))
    assert torch.equal(token_logprobs(logits, tokens, -1.0), token_logprobs(logits, tokens, 1.0))


def test_per_row_temperature_tensor_equals_scalar_rows() -> None:
    logits = torch.randn(3, 11)
    temps = torch.tensor([0.0, 0.7, 1.5])
    batched = tempered_log_softmax(logits, temps)
    for i, t in enumerate(temps.tolist()):
        assert torch.equal(batched[i], tempered_log_softmax(logits[i], t))


def test_half_precision_logits_are_upcast() -> None:
    logits = torch.randn(2, 9).to(torch.bfloat16)
    assert token_logprobs(logits, torch.tensor([1, 2]), 1.0).dtype == torch.float32


def test_next_token_logprobs_shifts_by_one() -> None:
    logits = torch.randn(1, 4, 6)
    ids = torch.tensor([[1, 2, 3, 4]])
    out = next_token_logprobs(logits, ids, 1.0)
    assert out.shape == (1, 3)
    assert torch.allclose(out[0, 0], torch.log_softmax(logits[0, 0], -1)[2])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-30, 30), min_size=2, max_size=20),
    st.floats(0.05, 5.0),
)
def test_logprobs_form_a_distribution(values: list[float], temperature: float) -> None:
    logits = torch.tensor(values)
    lp = tempered_log_softmax(logits, temperature)
    assert (lp <= 1e-6).all()
    assert math.isclose(torch.logsumexp(lp, -1).item(), 0.0, abs_tol=1e-5)
