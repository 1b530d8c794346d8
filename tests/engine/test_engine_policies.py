"""Several LoRA adapters served per request (engine --lora-adapters, modeling/served_lora.py): one batch
mixes sequences of two adapters and the base; each sequence's logprobs match the trainer's forward with
its own adapter attached within 1e-4 (fp32), and each answer carries its adapter's name and version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from harnessrl.engine.server import ServerThread
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.lora import attach, read_peft
from tests.support.engine_server import full_forward_logprobs, random_adapter_dir, start_server

pytest_plugins = ["tests.support.engine_fixtures"]

PROMPTS = [[1, 4093, 198, 2683, 314, 253, 1345], [1, 4093, 198, 7, 11, 906], [1, 28, 906, 30, 4093]]


def _trainer_logprobs(
    model_dir: Path, adapter_dir: Path | None, prompt: list[int], out: list[int]
) -> torch.Tensor:
    """The trainer's logprobs of `out` after `prompt`: the base model with the adapter hooked in."""
    model = load_model(model_dir)
    if adapter_dir is not None:
        spec, tensors = read_peft(adapter_dir)
        attach(model, spec).load_peft_tensors(tensors)
    return full_forward_logprobs(model, prompt, out, 1.0)


@pytest.fixture(scope="module")
def policy_server(engine_tiny_dir: Path) -> ServerThread:
    return start_server(engine_tiny_dir, "policies", lora_adapters=True, matmul="auto")


def test_one_batch_serves_each_sequence_with_its_adapter(
    policy_server: ServerThread, engine_tiny_dir: Path, tmp_path: Path
) -> None:
    dirs = {"planner": random_adapter_dir(engine_tiny_dir, tmp_path / "a", 3),
            "solver": random_adapter_dir(engine_tiny_dir, tmp_path / "b", 5)}  # fmt: skip
    url = policy_server.url
    for name, version in (("planner", 1), ("solver", 4)):
        r = httpx.post(url + "/admin/load_weights", json={"path": str(dirs[name]), "version": version,
                                                          "adapter": name}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json() == {"weight_version": version}

    async def complete(client: httpx.AsyncClient, model: str, prompt: list[int]) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 1,
                "return_token_ids": True, "ignore_eos": True, "seed": 7}  # fmt: skip
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            jobs = [complete(client, m, p) for m in ("planner", "solver", "base") for p in PROMPTS]
            return list(await asyncio.gather(*jobs))

    answers = asyncio.run(all_at_once())
    assert httpx.get(url + "/admin/stats").json()["max_batch_seen"] > 1  # sequences of several adapters
    outs = {}
    for i, (model, prompt) in enumerate((m, p) for m in ("planner", "solver", "base") for p in PROMPTS):
        ans = answers[i]
        choice = ans["choices"][0]
        ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert ans["weight_version"] == {"planner": 1, "solver": 4, "base": 0}[model]
        assert ans.get("adapter") == (None if model == "base" else model)
        ref = _trainer_logprobs(engine_tiny_dir, dirs.get(model), prompt, ids)
        assert float((torch.tensor(lps) - ref).abs().max()) < 1e-4, model
        outs[model, tuple(prompt)] = ids
    # the adapters do change what is sampled: logprobs under another adapter differ
    ids = outs["planner", tuple(PROMPTS[0])]
    other = _trainer_logprobs(engine_tiny_dir, dirs["solver"], PROMPTS[0], ids)
    mine = _trainer_logprobs(engine_tiny_dir, dirs["planner"], PROMPTS[0], ids)
    assert float((other - mine).abs().max()) > 1e-3


def test_adapter_loads_are_refused_clearly(
    policy_server: ServerThread, engine_server: ServerThread, engine_tiny_dir: Path, tmp_path: Path
) -> None:
    good = random_adapter_dir(engine_tiny_dir, tmp_path / "ok", 1)
    r = httpx.post(engine_server.url + "/admin/load_weights",
                   json={"path": str(good), "version": 1, "adapter": "x"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "--lora-adapters" in r.json()["error"]["message"]
    r = httpx.post(policy_server.url + "/admin/load_weights",
                   json={"path": str(tmp_path), "version": 1, "adapter": "x"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    r = httpx.post(policy_server.url + "/admin/load_weights",
                   json={"path": str(good), "version": 1, "adapter": "../bad name"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter"


def test_models_lists_the_base_then_each_served_adapter(
    policy_server: ServerThread, engine_tiny_dir: Path, tmp_path: Path
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=policy_server.url + "/v1", api_key="unused", max_retries=0)
    base = client.models.list().data[0].id
    for name, version, seed in (("lister-a", 4, 3), ("lister-b", 7, 4)):
        path = random_adapter_dir(engine_tiny_dir, tmp_path / name, seed)
        r = httpx.post(policy_server.url + "/admin/load_weights",
                       json={"path": str(path), "version": version, "adapter": name}, timeout=60)  # fmt: skip
        r.raise_for_status()
    models = client.models.list().data
    assert models[0].id == base and not hasattr(models[0], "parent")
    cards = {m.id: m.model_dump() for m in models[1:]}
    assert {k: (v["parent"], v["version"]) for k, v in cards.items() if k.startswith("lister")} == {
        "lister-a": (base, 4), "lister-b": (base, 7)
    }  # fmt: skip
