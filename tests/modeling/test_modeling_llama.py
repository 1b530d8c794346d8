"""Our plain-PyTorch Llama against transformers' LlamaForCausalLM, and its cache entry points."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harnessrl.modeling.llama import LlamaConfig, LlamaForCausalLM
from harnessrl.modeling.loading import load_model, save_model

HF_KEYS_PER_LAYER = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}


def _hf_logits(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


def _compare_with_hf(model_dir: Path, model: LlamaForCausalLM, seq: int) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, seq - 7 :] = 0  # right padding
    with torch.no_grad():
        ours = model(ids, mask)
    theirs = _hf_logits(model_dir, ids, mask)
    assert (ours[0] - theirs[0]).abs().max().item() < 1e-4
    assert (ours[1, : seq - 7] - theirs[1, : seq - 7]).abs().max().item() < 1e-4


def test_state_dict_keys_are_hf_names(engine_tiny_model: LlamaForCausalLM) -> None:
    keys = set(engine_tiny_model.state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(engine_tiny_model.config.num_hidden_layers):
        expected |= {f"model.layers.{i}.{k}" for k in HF_KEYS_PER_LAYER}
    assert keys == expected
    assert engine_tiny_model.lm_head.weight is engine_tiny_model.model.embed_tokens.weight


def test_config_round_trip_and_transformers5_rope_layout() -> None:
    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert LlamaConfig.from_hf_dict(d) == cfg
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    assert LlamaConfig.from_hf_dict(d).rope_theta == 5000.0


def test_tiny_matches_transformers(engine_tiny_dir: Path, engine_tiny_model: LlamaForCausalLM) -> None:
    _compare_with_hf(engine_tiny_dir, engine_tiny_model, seq=40)


def test_left_padding_gives_the_same_logits(engine_tiny_model: LlamaForCausalLM) -> None:
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain, left = engine_tiny_model(ids), engine_tiny_model(padded, mask)
    assert torch.isfinite(left).all()
    assert (plain[0] - left[0, 5:]).abs().max().item() < 1e-4


def test_prefill_and_batched_decode_match_full_forward(engine_tiny_model: LlamaForCausalLM) -> None:
    model = engine_tiny_model
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(max_batch=4, max_len=64)
    with torch.inference_mode():
        full = model(ids.unsqueeze(0))[0]
        assert (model.prefill(ids[:30], cache, slot=3, start=0) - full[29]).abs().max() < 1e-4
        cache.copy(3, 0, 30)  # slot 0: 30 tokens
        cache.copy(3, 1, 20)  # slot 1: reuse a 20-token prefix, prefill the rest from position 20
        assert (model.prefill(ids[20:35], cache, slot=1, start=20) - full[34]).abs().max() < 1e-4
        logits = model.decode(ids[[30, 35]], cache, torch.tensor([30, 35]))
    assert (logits[0] - full[30]).abs().max() < 1e-4
    assert (logits[1] - full[35]).abs().max() < 1e-4


def test_packed_prefill_of_several_sequences_matches_full_forwards(
    engine_tiny_model: LlamaForCausalLM,
) -> None:
    model = engine_tiny_model
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (9, 23, 40)]
    cache = model.new_cache(max_batch=4, max_len=64)
    with torch.inference_mode():
        fulls = [model(s.unsqueeze(0))[0] for s in seqs]
        model.prefill(seqs[2][:25], cache, slot=3, start=0)  # a cached prefix for the third sequence
        # three sequences in one packed pass, the third continuing from its cached 25 tokens
        last = model.prefill_many([(seqs[0], 0, 0), (seqs[1], 1, 0), (seqs[2][25:], 3, 25)], cache)
        for i in range(3):
            assert (last[i] - fulls[i][-1]).abs().max() < 1e-4
        cache.copy(3, 2, 40)
        nxt = torch.tensor([int(f[-1].argmax()) for f in fulls])
        step = model.decode(nxt, cache, torch.tensor([9, 23, 40]))
        for i in range(3):
            want = model(torch.cat([seqs[i], nxt[i : i + 1]]).unsqueeze(0))[0, -1]
            assert (step[i] - want).abs().max() < 1e-4


def test_save_and_load_round_trip(tmp_path: Path, engine_tiny_model: LlamaForCausalLM) -> None:
    out = save_model(engine_tiny_model, tmp_path / "copy")
    again = load_model(out)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(again(ids), engine_tiny_model(ids))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_smollm2_matches_transformers(smollm2_model_dir: Path) -> None:
    d = smollm2_model_dir
    model = load_model(d)
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    _compare_with_hf(d, model, seq=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_starts_zeroed(dtype: torch.dtype) -> None:
    """Decode reads masked positions past a short sequence; they must be finite (0 * NaN = NaN)."""
    from harnessrl.modeling.cache import KVCache

    junk = [torch.full((4096,), float("nan"), dtype=dtype) for _ in range(8)]  # dirty the allocator
    del junk
    cache = KVCache(layers=2, max_batch=3, kv_heads=2, max_len=16, head_dim=8, dtype=dtype)
    assert cache.kv.dtype == dtype and not cache.kv.any()
