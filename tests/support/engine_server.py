"""Helpers for the modeling and engine tests: tiny model dirs, live engine servers, logprob recompute.

The fixtures built on these live in `tests/support/engine_fixtures.py` (a pytest plugin: test modules name it in
`pytest_plugins`). Objects are cached per process, so every module shares one model dir and server per key.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import make_tiny_model_dir
from harnessrl.modeling.logprobs import next_token_logprobs
from tests.support.workers import torch_threads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_MAX_LEN = 512
_dirs: dict[str, Path] = {}
_servers: dict[str, ServerThread] = {}


def tiny_dir(root: Path, seed: int = 0) -> Path:
    """A tiny model dir (cached per seed for the whole test session)."""
    key = f"tiny-{seed}"
    if key not in _dirs:
        _dirs[key] = make_tiny_model_dir(root / key, seed=seed)
    return _dirs[key]


def start_server(model_dir: Path, key: str, **overrides: object) -> ServerThread:
    """A live engine server over loopback HTTP (cached by `key`; stopped at exit)."""
    if key not in _servers:
        cfg = EngineConfig(
            model=str(model_dir), max_batch=8, max_model_len=TINY_MAX_LEN, threads=torch_threads()
        )
        for name, value in overrides.items():
            setattr(cfg, name, value)
        server = ServerThread(Engine(cfg)).start()
        _servers[key] = server
        atexit.register(server.stop)
    return _servers[key]


def full_forward_logprobs(
    model: LlamaForCausalLM, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """token_logprobs of `completion` recomputed by one full training forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = next_token_logprobs(model(ids), ids, temperature)
    return lp[0, len(prompt) - 1 :]


def random_adapter_dir(model_dir: Path, out: Path, seed: int, scale: float = 0.2) -> Path:
    """A PEFT folder of a LoRA adapter (r 4) on `model_dir` whose B is random (a fresh adapter is the
    identity), so that it visibly changes the model's outputs."""
    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.lora import LoraSpec, attach, save_peft

    model = load_model(model_dir)
    adapter = attach(model, LoraSpec(r=4, alpha=8.0), seed=seed, base_model=str(model_dir))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in adapter.lora_B:
            b.copy_(torch.randn(b.shape, generator=gen) * scale)
    return save_peft(adapter, out, str(model_dir))
