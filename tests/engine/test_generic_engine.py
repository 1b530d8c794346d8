"""The builtin engine serving a transformers-path model (tiny Qwen3.5, hybrid) over real HTTP: concurrent
requests answer what each answers alone, logprobs equal the trainer's, a continued conversation reuses
the recurrent state whole (a partial match is prefilled again), streaming, and a weight reload; then a
PPO step of every generic family through the trainer, with the engine's logprobs as the old ones."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harnessrl.adapter import Batch, Row, loss_weights
from harnessrl.adapter.loss_weights import LossMode
from harnessrl.engine.core import Engine
from harnessrl.engine.server import EngineConfig, ServerThread
from harnessrl.modeling.loading import load_model, save_model
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.modeling.weight_stream import sync_state
from harnessrl.trainer.ppo import PPOConfig, ppo_update
from harnessrl.trainer.weights import EngineAdmin
from tests.support.generic_families import GENERIC, generic_dir

pytest.importorskip("transformers")
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def qwen35_engine() -> Iterator[ServerThread]:
    """The engine on the tiny Qwen3.5 (hybrid: linear-attention layers + one full-attention layer)."""
    cfg = EngineConfig(model=str(generic_dir("qwen3_5")), max_batch=4, max_model_len=512, threads=1)
    srv = ServerThread(Engine(cfg)).start()
    yield srv
    srv.stop()


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """One /v1/completions call with a token-ID prompt."""
    body = {"prompt": prompt, **GREEDY, **extra}
    out: dict[str, Any] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    return out


def test_served_concurrently_reused_whole_and_equal_to_the_trainer(qwen35_engine: ServerThread) -> None:
    url, engine = qwen35_engine.url, qwen35_engine.engine
    prompts = [[151644, *range(1000 + 7 * i, 1012 + 7 * i)] for i in range(3)]
    alone = [complete(url, p)["choices"][0] for p in prompts]

    async def together() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            calls = [c.post("/v1/completions", json={"prompt": p, **GREEDY}) for p in prompts]
            return [r.json()["choices"][0] for r in await asyncio.gather(*calls)]

    for a, b in zip(alone, asyncio.run(together()), strict=True):
        assert a["token_ids"] == b["token_ids"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True)) <= 1e-4  # fmt: skip
    model = engine.model
    ids = torch.tensor([prompts[0] + alone[0]["token_ids"]])
    with torch.no_grad():
        trainer = next_token_logprobs(model(ids), ids)[0, len(prompts[0]) - 1 :]
    assert float((trainer - torch.tensor(alone[0]["logprobs"]["token_logprobs"])).abs().max()) <= 1e-4
    # the next turn repeats prompt + completion: the slot's recurrent state continues from all of it
    turn2 = prompts[0] + alone[0]["token_ids"] + [151645, 198, 151644, 872]
    res = complete(url, turn2)
    assert res["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == len(prompts[0]) + 5
    ids = torch.tensor([turn2 + res["choices"][0]["token_ids"]])
    with torch.no_grad():
        trainer = next_token_logprobs(model(ids), ids)[0, len(turn2) - 1 :]
    assert (
        float((trainer - torch.tensor(res["choices"][0]["logprobs"]["token_logprobs"])).abs().max()) <= 1e-4
    )
    # a prompt sharing only part of a slot's tokens cannot cut a recurrent state back: prefilled whole
    partial = complete(url, [*prompts[1][:8], 42, 43])
    assert partial["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0


def test_streaming_and_a_weight_reload(qwen35_engine: ServerThread, tmp_path: Path) -> None:
    url, engine = qwen35_engine.url, qwen35_engine.engine
    prompt = [151644, 3, 4, 5, 6]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": prompt, **GREEDY, "stream": True}, timeout=120) as r:  # fmt: skip
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 6
    before = complete(url, prompt)["choices"][0]
    model = load_model(generic_dir("qwen3_5"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * 3.0
    save_model(model, tmp_path / "v1", state)
    r = httpx.post(
        url + "/admin/load_weights", json={"path": str(tmp_path / "v1"), "version": 1}, timeout=120
    )
    assert r.status_code == 200 and r.json()["weight_version"] == 1
    after = complete(url, prompt)["choices"][0]
    assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], state["model.norm.weight"])
    # the memory sync (no folder): the text model's own tensors, checked by the same names
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)  # type: ignore[operator]
    assert asyncio.run(_push(url, sync_state(model), 2)) == 2
    assert torch.equal(
        engine.model.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"]
    )
    assert complete(url, prompt)["choices"][0]["logprobs"] != after["logprobs"]


async def _push(url: str, state: dict[str, torch.Tensor], version: int) -> int:
    admin = EngineAdmin(url)
    try:
        return await admin.push_weights(state, version)
    finally:
        await admin.aclose()


@pytest.mark.parametrize("name", list(GENERIC))
def test_a_ppo_step_of_every_generic_family(name: str) -> None:
    """Old logprobs from the engine's arithmetic (cached decode) equal the trainer's: ratio 1, nothing
    clipped; the step changes the weights."""
    model = load_model(generic_dir(name))
    prompt = [2, 100, 200, 300, 400, 500]
    cache = model.new_cache(1, 64)
    tokens, lps = list(prompt), []
    with torch.no_grad():
        logits = model.prefill_many([(torch.tensor(prompt), 0, 0)], cache)
        for _ in range(5):
            lp = logits[0].log_softmax(-1)
            tokens.append(int(lp.argmax()))
            lps.append(float(lp.max()))
            logits = model.decode(torch.tensor(tokens[-1:]), cache, torch.tensor([len(tokens) - 1]))
    mask = [0] * len(prompt) + [1] * 5
    rows = [Row("r0", tokens, mask, [0.0] * len(prompt) + lps, 1.0)]
    batch = Batch(rows, [1.0], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = ppo_update(model, optimizer, batch, PPOConfig())
    assert metrics["clip_frac"] == 0.0 and metrics["mismatch_max"] <= 1e-4
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
