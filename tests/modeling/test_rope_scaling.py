"""RoPE scaling (linear, YaRN): the formula against transformers', our Llama against transformers'
LlamaForCausalLM with the same `rope_scaling`, the engine's logprobs against the trainer's full forward
past the original context, long-context model directories, and the KV cache's memory release."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.engine.config import DEFAULT_KV_TOKENS, EngineConfig
from harnessrl.engine.server import ServerThread
from harnessrl.modeling.cache import KVCache
from harnessrl.modeling.families import config_from_hf, config_to_hf
from harnessrl.modeling.llama import LlamaConfig
from harnessrl.modeling.loading import (
    default_cache_dir,
    load_model,
    make_tiny_model_dir,
    read_model_config,
    resolve_model,
    rope_scaled_config,
    save_model,
    write_rope_scaled_dir,
)
from harnessrl.modeling.rope import RopeScaling, RopeType, rope_frequencies
from harnessrl.trainer.forward import selected_logprobs
from tests.support.engine_server import full_forward_logprobs, start_server

ORIGINAL = 128  # the tiny model's "trained" context; scaled x4 to 512 (the engine tests' max_model_len)


def _hf_frequencies(params: dict[str, Any], head_dim: int, theta: float, max_pos: int) -> tuple[Any, float]:
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = HFConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=theta,
        max_position_embeddings=max_pos,
        rope_scaling=dict(params),
    )
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["linear", "yarn"]),
    factor=st.sampled_from([1.5, 2.0, 4.0, 8.0]),
    original=st.sampled_from([512, 2048, 8192]),
    betas=st.sampled_from([(32.0, 1.0), (16.0, 2.0), (64.0, 4.0)]),
    truncate=st.booleans(),
    head_dim=st.sampled_from([16, 64, 128]),
    theta=st.sampled_from([10000.0, 100000.0, 500000.0]),
)
def test_frequencies_equal_transformers(
    kind: str,
    factor: float,
    original: int,
    betas: tuple[float, float],
    truncate: bool,
    head_dim: int,
    theta: float,
) -> None:
    params: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        params.update(original_max_position_embeddings=original, beta_fast=betas[0], beta_slow=betas[1])
        params["truncate"] = truncate
    max_pos = int(original * factor)
    want_freq, want_mult = _hf_frequencies(params, head_dim, theta, max_pos)
    got_freq, got_mult = rope_frequencies(head_dim, theta, RopeScaling.from_hf(params, max_pos))
    assert torch.equal(got_freq, want_freq.float())
    assert got_mult == pytest.approx(want_mult, rel=1e-12)


@pytest.mark.parametrize(
    "extra", [{"attention_factor": 1.25}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"factor": None}]
)
def test_yarn_attention_factor_variants_equal_transformers(extra: dict[str, Any]) -> None:
    params: dict[str, Any] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    params.update(extra)
    want_freq, want_mult = _hf_frequencies(params, 64, 100000.0, 8192)
    got_freq, got_mult = rope_frequencies(64, 100000.0, RopeScaling.from_hf(params, 8192))
    assert torch.equal(got_freq, want_freq.float())
    assert got_mult == pytest.approx(want_mult, rel=1e-12)


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones() -> None:
    plain, _ = rope_frequencies(64, 100000.0, None)
    scaling = RopeScaling(RopeType.YARN, 4.0, original_max_position_embeddings=8192)
    yarn, mult = rope_frequencies(64, 100000.0, scaling)
    assert torch.equal(yarn[:4], plain[:4])  # many turns within the original context: untouched
    assert torch.allclose(yarn[-4:], plain[-4:] / 4.0)  # under one turn: fully interpolated
    assert mult > 1.0
    linear, lmult = rope_frequencies(64, 100000.0, RopeScaling(RopeType.LINEAR, 4.0))
    assert torch.allclose(linear, plain / 4.0) and lmult == 1.0


def test_config_round_trip_and_both_transformers_layouts() -> None:
    scaling = RopeScaling(RopeType.YARN, 2.0, original_max_position_embeddings=8192, beta_fast=16.0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=16384, rope_scaling=scaling)  # fmt: skip
    d = config_to_hf(cfg)
    assert d["rope_scaling"]["rope_type"] == "yarn"
    assert d["rope_parameters"] == {"rope_theta": cfg.rope_theta, **d["rope_scaling"]}
    assert config_from_hf(d) == cfg
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}  # transformers 4.x
    legacy["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                              "beta_fast": 16}  # fmt: skip
    assert config_from_hf(legacy) == cfg
    new = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}  # transformers 5.x
    assert config_from_hf(new) == cfg


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "not supported"),
        ({"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1"),
        ({"rope_type": "linear"}, "factor must be a number"),
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 8192,
                "beta_fast": 1.0,
                "beta_slow": 4.0,
            },
            "beta_fast must be >= beta_slow",
        ),
    ],
)
def test_unsupported_or_bad_scaling_is_refused_by_name(params: dict[str, Any], message: str) -> None:
    d = config_to_hf(LlamaConfig())
    d["rope_scaling"] = params
    with pytest.raises(ValueError, match=message):
        config_from_hf(d)


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model whose original context is ORIGINAL tokens."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("rope") / "tiny-128", seed=5, max_positions=ORIGINAL)


@pytest.fixture(scope="module", params=["linear", "yarn"])
def scaled_dir(request: pytest.FixtureRequest, short_dir: Path) -> Path:
    """The tiny model scaled x4 (context 512) by `write_rope_scaled_dir`, as smollm2-16k is made."""
    return write_rope_scaled_dir(short_dir, short_dir.parent / f"tiny-512-{request.param}", request.param, 4)


def test_scaled_dir_shares_the_weights_and_reads_back(short_dir: Path, scaled_dir: Path) -> None:
    cfg = read_model_config(scaled_dir)
    assert cfg.max_position_embeddings == 4 * ORIGINAL
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
    src, dst = short_dir / "model.safetensors", scaled_dir / "model.safetensors"
    assert dst.read_bytes() == src.read_bytes()
    assert all((scaled_dir / f).is_file() for f in ("tokenizer.json", "chat_template.jinja"))
    assert write_rope_scaled_dir(short_dir, scaled_dir, "yarn", 2) == scaled_dir  # cached: not rebuilt
    with pytest.raises(ValueError, match="already scaled"):
        rope_scaled_config(json.loads((scaled_dir / "config.json").read_text()), "yarn", 2)


def test_scaled_model_matches_transformers_past_the_original_context(scaled_dir: Path) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    ours = load_model(scaled_dir)
    theirs = HFLlama.from_pretrained(str(scaled_dir), dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == ours.config.rope_scaling.rope_type  # type: ignore[union-attr]
    ids = torch.randint(0, 49152, (2, 3 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -20:] = 0  # right padding
    with torch.no_grad():
        got, want = ours(ids, mask), theirs(input_ids=ids, attention_mask=mask).logits
        plain = load_model(scaled_dir.parent / "tiny-128")(ids, mask)
    assert (got[0] - want[0]).abs().max().item() < 1e-4
    assert (got[1, :-20] - want[1, :-20]).abs().max().item() < 1e-4
    assert (got - plain).abs().max().item() > 1e-3  # the scaling did change the model (10x the bound)


def test_save_model_keeps_the_scaling(tmp_path: Path, scaled_dir: Path) -> None:
    model = load_model(scaled_dir)
    again = load_model(save_model(model, tmp_path / "ckpt"))
    assert again.config == model.config
    ids = torch.arange(1, 2 * ORIGINAL).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


async def _together(server: ServerThread, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        await client.post("/admin/pause")
        tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
        while (await client.get("/admin/stats")).json()["waiting"] < len(bodies):
            await asyncio.sleep(0.01)
        await client.post("/admin/resume")
        responses = await asyncio.gather(*tasks)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_engine_logprobs_equal_the_trainer_under_scaling(scaled_dir: Path) -> None:
    """Batched decode, chunked prefill and a prefix-cache hit, all past the original 128 positions."""
    trainer = load_model(scaled_dir)  # what the trainer loads from the same directory
    server = start_server(scaled_dir, f"rope-{scaled_dir.name}", max_model_len=None, prefill_chunk=48)
    assert server.engine.max_model_len == 4 * ORIGINAL  # the model's context, not the flag's default
    gen = torch.Generator().manual_seed(1)
    prompts = [[1, *torch.randint(3, 49152, (n,), generator=gen).tolist()] for n in (40, 150, 300)]
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": t, "seed": i, "logprobs": 0, "ignore_eos": True}
              for i, (p, t) in enumerate(zip(prompts, (1.0, 0.7, 1.0), strict=True))]  # fmt: skip
    results = asyncio.run(_together(server, bodies))
    first = results[2]["choices"][0]["token_ids"]
    follow = {**bodies[2], "prompt": prompts[2] + first + [198, 30, 31], "seed": 9}
    results.append(asyncio.run(_together(server, [follow]))[0])
    assert results[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300  # prefix reused
    for body, res in zip([*bodies, follow], results, strict=True):
        ids = res["choices"][0]["token_ids"]
        got = torch.tensor(res["choices"][0]["logprobs"]["token_logprobs"])
        want = full_forward_logprobs(trainer, res["prompt_token_ids"], ids, body["temperature"])
        assert (got - want).abs().max().item() < 1e-4
        # and through the trainer's own path (shared-prefix forward, selected positions only)
        tokens = torch.tensor([res["prompt_token_ids"] + ids])
        select = torch.zeros(1, tokens.shape[1] - 1, dtype=torch.bool)
        select[0, len(res["prompt_token_ids"]) - 1 :] = True
        temps = torch.tensor([body["temperature"]])
        prefix = min(100, len(res["prompt_token_ids"]) - 1)  # computed once for both rows
        with torch.no_grad():
            sel = selected_logprobs(
                trainer, tokens.expand(2, -1), select.expand(2, -1), temps.expand(2), prefix
            )
        assert (sel.logprobs.view(2, -1) - got).abs().max().item() < 1e-4


def test_engine_caps_max_model_len_at_the_model_context(short_dir: Path) -> None:
    server = start_server(short_dir, "rope-short", max_model_len=4 * ORIGINAL)
    assert server.engine.max_model_len == ORIGINAL
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": list(range(3, 3 + ORIGINAL)), "max_tokens": 4}
    )
    assert r.status_code == 400 and "maximum context length is 128" in r.text


def test_kv_budget_default_bounds_long_contexts() -> None:
    assert EngineConfig(max_batch=16).kv_budget(8192) == 16 * 8192  # unchanged for 8k models
    assert EngineConfig(max_batch=32).kv_budget(2048) == 32 * 2048
    assert EngineConfig(max_batch=16).kv_budget(32768) == DEFAULT_KV_TOKENS  # 4 sequences of 32k
    assert EngineConfig(max_batch=2).kv_budget(200_000) == 200_000  # at least one whole sequence
    with pytest.raises(ValueError, match="at least one sequence"):
        EngineConfig(max_cached_tokens=1000).kv_budget(4096)


def _resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_kv_release_returns_pages_and_reads_zero() -> None:
    cache = KVCache(layers=4, max_batch=3, kv_heads=3, max_len=8192, head_dim=64)  # 48 MiB a slot
    before = _resident_mb()
    cache.kv[:, :, 1].fill_(1.0)
    grown = _resident_mb() - before
    assert grown > 40
    assert cache.release(1, 100) > 47 * 2**20  # of 48 MiB
    assert _resident_mb() - before < grown / 4  # the pages went back to the OS
    assert bool(cache.kv[:, :, 1, :, :100].eq(1).all())  # live positions kept
    assert not cache.kv[:, :, 1, :, 112:].any()  # whole pages past them read as zeros
    assert bool(cache.kv[:, :, [0, 2]].eq(0).all())  # other slots untouched


def test_prefix_cache_is_trimmed_to_the_budget_and_its_memory_released(short_dir: Path) -> None:
    """Long prompts leave at most the budget behind as prefix cache, and stale pages are given back."""
    scaled = write_rope_scaled_dir(short_dir, short_dir.parent / "tiny-4096", "yarn", 32)
    server = start_server(scaled, "rope-trim", max_model_len=None, max_cached_tokens=5000)
    cache, slots = server.engine.scheduler.cache, server.engine.scheduler.slots
    gen = torch.Generator().manual_seed(4)
    for n in (3000, 3000, 50):  # each long prompt evicts the other's cache; the short one reuses a slot
        prompt = [1, *torch.randint(3, 49152, (n,), generator=gen).tolist()]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
        assert slots.cached_tokens() <= 5000
    assert slots.cached_tokens() <= 3002 + 52
    # no slot keeps more resident positions than its cached tokens, but for RELEASE_MIN_POSITIONS
    assert all(t - len(toks) < 256 for t, toks in zip(slots.touched, slots.tokens, strict=True))
    assert cache.max_len == 4096


_SMOLLM2 = default_cache_dir() / "SmolLM2-135M-Instruct" / "model.safetensors"


def test_long_names_resolve_and_bad_ones_are_refused() -> None:
    with pytest.raises(ValueError, match="16k, 24k, 32k"):
        resolve_model("smollm2-12k")
    with pytest.raises(FileNotFoundError, match="smollm2-16k"):
        resolve_model("smollm2-16q")


def test_smollm2_16k_directory(smollm2_model_dir: Path) -> None:
    d = resolve_model("smollm2-16k")
    cfg = read_model_config(d)
    assert d.name == "SmolLM2-135M-Instruct-yarn-16k" and cfg.max_position_embeddings == 16384
    assert cfg.rope_scaling == RopeScaling(RopeType.YARN, 2.0, original_max_position_embeddings=8192)
    assert (d / "model.safetensors").stat().st_ino == _SMOLLM2.stat().st_ino  # hard-linked, not copied
    assert read_model_config(resolve_model("smollm2-32k-linear")).rope_scaling == RopeScaling(
        RopeType.LINEAR, 4.0
    )


@pytest.mark.slow
def test_smollm2_16k_engine_equals_trainer_past_8k_positions(smollm2_model_dir: Path) -> None:
    """The real SmolLM2 (whose logits, unlike the tiny model's, show a slightly inexact kernel) scaled to
    16k: the engine's logprobs for tokens at positions past its original 8,192 equal the trainer's."""
    from pydoc_data.topics import topics

    from harnessrl.engine.server import Engine
    from harnessrl.modeling.loading import load_tokenizer
    from harnessrl.modeling.logprobs import token_logprobs

    d = resolve_model("smollm2-16k")
    text = "\n\n".join(topics[k] for k in sorted(topics))
    prompt = load_tokenizer(d).encode(text).ids[:8400]
    engine = Engine(EngineConfig(model=str(d), max_batch=1, threads=2, prefix_cache=False))
    server = ServerThread(engine).start()
    try:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 0, "logprobs": 0}
        res = httpx.post(server.url + "/v1/completions", json=body, timeout=1800).json()
    finally:
        server.stop()
        engine.shutdown()
    choice = res["choices"][0]
    ids = torch.tensor([prompt + choice["token_ids"]])
    trainer = load_model(d)
    with torch.inference_mode():
        hidden = trainer.hidden_states(ids)[0, len(prompt) - 1 : -1]
        want = token_logprobs(trainer.logits(hidden), ids[0, len(prompt) :], 0.7)
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert (got - want).abs().max().item() < 1e-4
