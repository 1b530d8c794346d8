"""LoRA through the trainer's plumbing: the engine gets only the adapter (a PEFT folder) and serves it
merged, with the trainer's logprobs; checkpoints keep and restore the adapter; the config refuses
what is not wired yet."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from harnessrl.config import load_config
from harnessrl.engine.config import EngineConfig
from harnessrl.engine.core import Engine
from harnessrl.engine.server import ServerThread
from harnessrl.errors import ConfigError
from harnessrl.modeling.loading import load_model, load_state_dict_file
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.modeling.lora import ADAPTER_WEIGHTS, LoraAdapter, LoraSpec, attach
from harnessrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from harnessrl.trainer.export_model import export_model
from harnessrl.trainer.weights import EngineAdmin, publish_weights

PROMPT = [1, 4093, 198, 2683, 314, 253, 1345, 28, 906, 30, 2, 198]


@pytest.fixture(scope="module")
def lora_server(engine_tiny_dir: Path) -> Iterator[ServerThread]:
    """An engine of its own (these tests change its weights), on the packed oneDNN path if available."""
    cfg = EngineConfig(model=str(engine_tiny_dir), max_batch=4, max_model_len=512, threads=1)
    server = ServerThread(Engine(cfg)).start()
    yield server
    server.stop()


def _trained(model_dir: Path, seed: int) -> tuple[torch.nn.Module, LoraAdapter]:
    model = load_model(model_dir)
    adapter = attach(model, LoraSpec(r=4), seed=seed, base_model=str(model_dir))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.lora_B:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model, adapter


async def _publish(
    url: str, model: torch.nn.Module, weights: Path, version: int, adapter: LoraAdapter
) -> None:
    admin = EngineAdmin(url)
    try:
        await publish_weights(model, admin, weights, version, adapter)  # type: ignore[arg-type]
    finally:
        await admin.aclose()


def _generate(url: str) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "logprobs": 0,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def _trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return next_token_logprobs(model(ids), ids, 1.0)[0, len(prompt) - 1 :]


def test_engine_serves_the_published_adapter_with_the_trainers_logprobs(
    lora_server: ServerThread, engine_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sync moves the adapter only, and the engine swaps it into the weights it holds: the base
    folder is never read again (reading any weights file from disk fails here)."""

    def no_disk_read(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the engine read weights from disk during a LoRA sync: {args}")

    monkeypatch.setattr("harnessrl.engine.core.load_state_dict_file", no_disk_read)
    for version, seed in ((1, 11), (2, 12), (3, 13)):  # each adapter replaces the one before (not added)
        model, adapter = _trained(engine_tiny_dir, seed)
        asyncio.run(_publish(lora_server.url, model, tmp_path / "weights", version, adapter))
        pushed = sorted(p.name for p in (tmp_path / "weights" / f"v{version}").iterdir())
        assert pushed == ["adapter_config.json", ADAPTER_WEIGHTS]  # no base weights travel
        res = _generate(lora_server.url)
        assert res["weight_version"] == version
        choice = res["choices"][0]
        ours = _trainer_logprobs(model, res["prompt_token_ids"], choice["token_ids"])
        base = _trainer_logprobs(load_model(engine_tiny_dir), res["prompt_token_ids"], choice["token_ids"])
        reported = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert (reported - base).abs().max() > 1e-3  # served by the adapter, not the base
        assert (reported - ours).abs().max() < 1e-4
    assert not (tmp_path / "weights" / "v1").exists()


def test_after_a_level_2_sleep_the_adapter_is_served_on_the_base_read_again(
    lora_server: ServerThread, engine_tiny_dir: Path, tmp_path: Path
) -> None:
    """Weights discarded (sleep level 2): the next sync reads the base once and serves the adapter on it;
    the sync after that swaps from memory again, with the trainer's logprobs both times."""

    async def sleep_wake() -> None:
        admin = EngineAdmin(lora_server.url)
        try:
            await admin.sleep(2)
            await admin.wake_up()
        finally:
            await admin.aclose()

    asyncio.run(sleep_wake())
    for version, seed in ((11, 31), (12, 32)):
        model, adapter = _trained(engine_tiny_dir, seed)
        asyncio.run(_publish(lora_server.url, model, tmp_path / "weights", version, adapter))
        res = _generate(lora_server.url)
        choice = res["choices"][0]
        ours = _trainer_logprobs(model, res["prompt_token_ids"], choice["token_ids"])
        assert res["weight_version"] == version
        assert (torch.tensor(choice["logprobs"]["token_logprobs"]) - ours).abs().max() < 1e-4


def test_checkpoint_keeps_the_adapter_and_the_base_name(engine_tiny_dir: Path, tmp_path: Path) -> None:
    """A LoRA checkpoint holds the adapter and names the base folder (no merged copy of the model);
    export-model merges it into that base; resuming restores the adapter and its optimizer state."""
    model, adapter = _trained(engine_tiny_dir, 21)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
    torch.log_softmax(model(torch.tensor([PROMPT])), -1).mean().backward()
    optimizer.step()
    ckpt = save_checkpoint(
        tmp_path / "run" / "checkpoints", 1, model, optimizer, {"run_id": "r"}, lora=adapter
    )
    assert not (ckpt / "model.safetensors").exists()
    assert json.loads((ckpt / "state.json").read_text())["base_model"] == str(engine_tiny_dir)
    assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(engine_tiny_dir)
    merged = load_model(export_model(tmp_path / "run", tmp_path / "exported"))  # base + adapter, merged
    with torch.no_grad():
        assert (merged(torch.tensor([PROMPT])) - model(torch.tensor([PROMPT]))).abs().max() < 1e-5
    fresh_model, fresh = _trained(engine_tiny_dir, 99)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = load_checkpoint(ckpt, fresh_model, fresh_opt, lora=fresh)
    assert state["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), adapter.parameters(), strict=True))
    base = load_state_dict_file(engine_tiny_dir)
    assert all(torch.equal(v, base[k]) for k, v in fresh_model.state_dict().items() if k in base)
    assert len(fresh_opt.state) == len(list(adapter.parameters()))


def test_config_turns_lora_on_and_refuses_what_is_not_wired() -> None:
    assert load_config().train.lora is None
    cfg = load_config(overrides=["train.lora.r=16", "train.lr=2e-4"])
    assert cfg.train.lora is not None and cfg.train.lora.r == 16 and cfg.train.lora.alpha == 16.0
    assert "down_proj" in cfg.train.lora.target_modules
    assert load_config(overrides=["train.lora={}"]).train.lora is not None
    with pytest.raises(ConfigError, match=r"engine\.kind"):
        load_config(overrides=["train.lora={}", "engine.kind=vllm"])
    with pytest.raises(ConfigError, match="world_size"):
        load_config(overrides=["train.lora={}", "train.world_size=2"])
    with pytest.raises(ConfigError, match="greater than or equal to 1"):
        load_config(overrides=["train.lora.r=0"])
