"""Pure parts of the engine: sampling, detokenization and stop strings, the slot table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.engine.detok import StopChecker, TokenText
from harnessrl.engine.sampling import SamplingParams, _top_p_filter, make_generator, sample_step
from harnessrl.engine.slots import SlotTable, common_prefix_len
from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.loading import load_tokenizer
from harnessrl.modeling.logprobs import token_logprobs


@pytest.fixture(scope="module")
def text(engine_tiny_dir: Path) -> TokenText:
    return TokenText(load_tokenizer(engine_tiny_dir))


def test_greedy_and_logprob_definition() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(max_tokens=1, temperature=t) for t in (0.0, 0.7, 1.0)]
    gens = [make_generator(i, torch.device("cpu")) for i in range(3)]
    out = sample_step(logits, params, gens)
    assert out.tokens[0] == int(logits[0].argmax())
    for i, p in enumerate(params):
        ref = token_logprobs(logits[i], torch.tensor(out.tokens[i]), p.temperature)
        assert out.logprobs[i] == pytest.approx(ref.item(), abs=1e-6)


def test_seeded_sampling_is_deterministic() -> None:
    logits = torch.randn(1, 1000)
    p = [SamplingParams(max_tokens=1, temperature=1.0, seed=7)]
    draws = [
        [sample_step(logits, p, [g]).tokens[0] for _ in range(20)]
        for g in (make_generator(7, torch.device("cpu")), make_generator(7, torch.device("cpu")))
    ]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = _top_p_filter(probs, 0.7)
    assert kept.tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert _top_p_filter(probs, 0.01).nonzero().flatten().tolist() == [0]
    logits = probs.log().unsqueeze(0)
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7)]
    gen = make_generator(0, torch.device("cpu"))
    assert {sample_step(logits, params, [gen]).tokens[0] for _ in range(50)} <= {0, 1}


def test_top_k_draws_only_the_k_most_likely_and_logprobs_stay_untruncated() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    gen = make_generator(0, torch.device("cpu"))
    for k, allowed in ((1, {0}), (3, {0, 1, 2})):
        params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=k)]
        draws = [sample_step(logits, params, [gen]) for _ in range(60)]
        assert {d.tokens[0] for d in draws} <= allowed
        full = torch.log_softmax(logits[0], -1)
        assert all(d.logprobs[0] == pytest.approx(full[d.tokens[0]].item(), abs=1e-6) for d in draws)
    both = [SamplingParams(max_tokens=1, temperature=1.0, top_k=3, top_p=0.5)]  # top-k, then top-p
    assert {sample_step(logits, both, [gen]).tokens[0] for _ in range(60)} <= {0, 1}


def test_top_logprobs_are_sorted_and_sized() -> None:
    logits = torch.randn(2, 100)
    params = [SamplingParams(max_tokens=1, temperature=0, top_logprobs=3), SamplingParams(max_tokens=1)]
    out = sample_step(logits, params, [make_generator(0, torch.device("cpu"))] * 2)
    assert len(out.top[0]) == 3 and out.top[1] == []
    assert out.top[0][0][0] == out.tokens[0]  # greedy: the sampled token is the most likely
    assert [lp for _, lp in out.top[0]] == sorted((lp for _, lp in out.top[0]), reverse=True)


def test_token_text_matches_tokenizer_decode(text: TokenText) -> None:
    tok = text.tokenizer
    s = "héllo wörld 你好 🎉 <|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(s).ids
    assert text.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False) == s
    assert text.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert b"".join(text.token_bytes(i) for i in ids).decode() == s


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=30))
def test_token_text_decode_property(text: TokenText, ids: list[int]) -> None:
    assert text.decode(ids) == text.tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_checker_finds_the_first_stop(text: TokenText) -> None:
    ids = text.tokenizer.encode("The answer is 42. END and more END").ids
    checker = StopChecker(text, ["END", "zzz"], skip_special_tokens=True)
    hits = [h for h in (checker.add(i) for i in ids) if h is not None]
    assert hits[0] == ("The answer is 42. ", "END")


def test_stop_checker_across_a_split_utf8_character(text: TokenText) -> None:
    ids = text.tokenizer.encode("ab🎉cd").ids
    checker = StopChecker(text, ["🎉"], skip_special_tokens=True)
    hits = [h for h in (checker.add(i) for i in ids) if h is not None]
    assert hits[0] == ("ab", "🎉")


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_len(a: list[int], b: list[int]) -> None:
    n = common_prefix_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


class _Seq:
    def __init__(self, prompt: list[int], out: list[int], adapter: str | None = None) -> None:
        self.kv_tokens = prompt + out[:-1]
        self.kv_len = len(self.kv_tokens)
        self.adapter = adapter  # the served LoRA adapter (several policies); None: the base


def _cache(n: int = 4) -> KVCache:
    return KVCache(layers=1, max_batch=n, kv_heads=1, max_len=64, head_dim=2)


def test_slots_stay_packed_and_keep_kv_with_their_sequence() -> None:
    cache = _cache()
    table = SlotTable(cache, prefix_cache=True)
    seqs = [_Seq([i] * 4, [9, 9]) for i in range(3)]
    for i, s in enumerate(seqs):
        slot, start = table.admit(s, [i] * 4)  # type: ignore[arg-type]
        assert (slot, start) == (i, 0)
        cache.kv[:, :, slot, :, :5] = float(i)  # "prefill": each slot's K/V marked with its owner
    table.release(seqs[0])  # type: ignore[arg-type]
    assert table.n_active == 2
    assert table.active() == [seqs[2], seqs[1]]  # the last one moved into the hole, with its K/V
    assert cache.kv[0, 0, 0, 0, 0, 0].item() == 2.0
    assert table.tokens[2] == [0, 0, 0, 0, 9]  # the finished sequence's K/V stay as prefix cache
    assert cache.kv[0, 0, 2, 0, 0, 0].item() == 0.0


def test_prefix_cache_reuse_moves_the_matching_slot_in() -> None:
    cache = _cache()
    table = SlotTable(cache, prefix_cache=True)
    old = _Seq(list(range(100, 140)), [1, 2])
    table.admit(old, old.kv_tokens)  # type: ignore[arg-type]
    cache.kv[:, :, 0] = 5.0
    table.release(old)  # type: ignore[arg-type]
    other = _Seq([7, 7, 7], [1])
    table.admit(other, [7, 7, 7])  # type: ignore[arg-type]  # takes slot 0, moving the cached K/V away
    prompt = [*list(range(100, 140)), 1, 50, 51]
    slot, start = table.admit(_Seq(prompt, [3]), prompt)  # type: ignore[arg-type]
    assert (slot, start) == (1, 41)
    assert cache.kv[0, 0, 1, 0, 40, 0].item() == 5.0
    table.clear_cache()
    assert table.cached_tokens() == 0


def test_prefix_cache_disabled_never_reuses() -> None:
    table = SlotTable(_cache(), prefix_cache=False)
    s = _Seq(list(range(50)), [1, 2])
    table.admit(s, s.kv_tokens)  # type: ignore[arg-type]
    table.release(s)  # type: ignore[arg-type]
    assert table.admit(_Seq(list(range(60)), [1]), list(range(60))) == (0, 0)  # type: ignore[arg-type]


def test_prefix_cache_is_reused_only_within_an_adapter() -> None:
    """K/V computed under one LoRA adapter are never reused by a sequence of another (or the base)."""
    table = SlotTable(_cache(), prefix_cache=True)
    first = _Seq([5, 6, 7, 8, 9, 10], [11, 12], adapter="planner")
    table.admit(first, first.kv_tokens)  # type: ignore[arg-type]
    table.release(first)  # type: ignore[arg-type]
    prompt = [5, 6, 7, 8, 9, 10, 11, 13]
    assert table.admit(_Seq(prompt, [1], adapter="solver"), prompt)[1] == 0  # type: ignore[arg-type]
    assert table.admit(_Seq(prompt, [1]), prompt)[1] == 0  # type: ignore[arg-type]
    assert table.admit(_Seq(prompt, [1], adapter="planner"), prompt)[1] == 7  # type: ignore[arg-type]
