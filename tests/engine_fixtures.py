"""Shared fixtures for the modeling and engine tests: a tiny real-tokenizer model and live engine servers.

Import the fixtures you use into a test module (`from tests.engine_fixtures import engine_tiny_dir`).
Objects are cached per process, so several modules importing the same fixture share one model dir and one
server. Names are prefixed `engine_` so they never shadow conftest.py's fixtures.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model, make_tiny_model_dir

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
        cfg = EngineConfig(model=str(model_dir), max_batch=8, max_model_len=TINY_MAX_LEN, threads=2)
        for name, value in overrides.items():
            setattr(cfg, name, value)
        server = ServerThread(Engine(cfg)).start()
        _servers[key] = server
        atexit.register(server.stop)
    return _servers[key]


@pytest.fixture(scope="session")
def engine_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama (hidden 64, 2 layers) with SmolLM2's real tokenizer."""
    return tiny_dir(tmp_path_factory.getbasetemp() / "engine-models")


@pytest.fixture(scope="session")
def engine_tiny_model(engine_tiny_dir: Path) -> LlamaForCausalLM:
    """The tiny model loaded in fp32 (for recomputing logprobs)."""
    return load_model(engine_tiny_dir)


@pytest.fixture(scope="session")
def engine_server(engine_tiny_dir: Path) -> Iterator[ServerThread]:
    """A shared engine server on the tiny model (tests must not change its weights)."""
    yield start_server(engine_tiny_dir, "shared")


def full_forward_logprobs(
    model: LlamaForCausalLM, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """token_logprobs of `completion` recomputed by one full training forward over prompt + completion."""
    from harnessrl.modeling.logprobs import next_token_logprobs

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = next_token_logprobs(model(ids), ids, temperature)
    return lp[0, len(prompt) - 1 :]
