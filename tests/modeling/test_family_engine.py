"""Engine against trainer for every family: the builtin engine's logprobs (batched decode, chunked
prefill, a prefix-cache hit) equal the trainer's recomputation from the same folder within 1e-4 (fp32),
through the full forward and the trainer's own shared-prefix path. Tiny random models with each family's
real tokenizer (tests/support/families.py); Gemma 3's sliding window (16 keys) bites in these lengths."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from harnessrl.engine.server import ServerThread
from harnessrl.modeling.loading import load_model, load_tokenizer
from harnessrl.trainer.forward import selected_logprobs
from tests.support.engine_server import full_forward_logprobs, start_server
from tests.support.families import FAMILIES, have_tokenizer, tiny_family_dir

pytestmark = pytest.mark.skipif(
    not all(have_tokenizer(f) for f in FAMILIES), reason="real tokenizers missing: run make install"
)


async def _together(server: ServerThread, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Post all bodies while the engine is paused, so they are prefilled and decoded as one batch."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        await client.post("/admin/pause")
        tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
        while (await client.get("/admin/stats")).json()["waiting"] < len(bodies):
            await asyncio.sleep(0.01)
        await client.post("/admin/resume")
        responses = await asyncio.gather(*tasks)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


# Llama 3.0 is Llama 3.2's architecture without its rope scaling: its run is in `pytest -m slow`
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f == "llama3" else f for f in FAMILIES]
)
def test_engine_logprobs_equal_the_trainer(tmp_path_factory: pytest.TempPathFactory, family: str) -> None:
    d = tiny_family_dir(family, tmp_path_factory.getbasetemp() / "families")
    trainer = load_model(d)
    server = start_server(d, f"family-{family}", max_model_len=256, prefill_chunk=24)
    vocab = load_tokenizer(d).get_vocab_size()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (10, 40, 70)]
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": t, "seed": i, "logprobs": 0, "ignore_eos": True}
              for i, (p, t) in enumerate(zip(prompts, (1.0, 0.7, 1.0), strict=True))]  # fmt: skip
    results = asyncio.run(_together(server, bodies))
    first = results[2]["choices"][0]["token_ids"]
    follow = {**bodies[2], "prompt": prompts[2] + first + [5, 6, 7], "seed": 9}
    results.append(asyncio.run(_together(server, [follow]))[0])
    assert results[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 70  # prefix reused
    for body, res in zip([*bodies, follow], results, strict=True):
        ids = res["choices"][0]["token_ids"]
        assert len(ids) == 24
        got = torch.tensor(res["choices"][0]["logprobs"]["token_logprobs"])
        want = full_forward_logprobs(trainer, res["prompt_token_ids"], ids, body["temperature"])
        assert (got - want).abs().max().item() < 1e-4
        tokens = torch.tensor([res["prompt_token_ids"] + ids])
        select = torch.zeros(1, tokens.shape[1] - 1, dtype=torch.bool)
        select[0, len(res["prompt_token_ids"]) - 1 :] = True
        prefix = min(30, len(res["prompt_token_ids"]) - 1)  # shared prefix computed once for both rows
        temps = torch.tensor([body["temperature"]])
        with torch.no_grad():
            sel = selected_logprobs(
                trainer, tokens.expand(2, -1), select.expand(2, -1), temps.expand(2), prefix
            )
        assert (sel.logprobs.view(2, -1) - got).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_engine_serves_bf16_close_to_the_bf16_trainer(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """bf16 weights in the engine: a batch decodes, and its logprobs follow the trainer's bf16 forward
    as closely as bf16 allows (each product rounds to 8 mantissa bits; docs/models.md)."""
    d = tiny_family_dir(family, tmp_path_factory.getbasetemp() / "families")
    trainer = load_model(d, dtype=torch.bfloat16)
    server = start_server(d, f"family-{family}-bf16", max_model_len=256, dtype="bfloat16")
    assert next(server.engine.model.parameters()).dtype == torch.bfloat16
    vocab = load_tokenizer(d).get_vocab_size()
    gen = torch.Generator().manual_seed(5)
    bodies = [{"prompt": torch.randint(3, vocab, (n,), generator=gen).tolist(), "max_tokens": 12,
               "temperature": 1.0, "seed": n, "logprobs": 0, "ignore_eos": True} for n in (9, 33)]  # fmt: skip
    for res in asyncio.run(_together(server, bodies)):
        ids = res["choices"][0]["token_ids"]
        got = torch.tensor(res["choices"][0]["logprobs"]["token_logprobs"])
        want = full_forward_logprobs(trainer, res["prompt_token_ids"], ids, 1.0).float()
        assert len(ids) == 12 and torch.isfinite(got).all()
        assert (got - want).abs().mean().item() < 0.1, (got, want)


def test_every_eos_id_of_the_folder_stops_the_engine(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Llama 3 lists three eos ids in config.json (<|end_of_text|>, <|eom_id|>, <|eot_id|>): all stop."""
    d = tiny_family_dir("llama3_2", tmp_path_factory.getbasetemp() / "families")
    server = start_server(d, "family-llama3_2", max_model_len=256, prefill_chunk=24)
    assert {128001, 128008, 128009} <= server.engine.eos_ids
