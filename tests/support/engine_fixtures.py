"""Fixtures for the modeling and engine tests (a pytest plugin).

Use with `pytest_plugins = ["tests.support.engine_fixtures"]` in a test module; helpers are in
`tests/support/engine_server.py`. Names are prefixed `engine_` so they never shadow conftest.py's fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.engine.server import ServerThread
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.loading import load_model
from tests.support.engine_server import start_server, tiny_dir


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
