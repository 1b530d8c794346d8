"""Shared fixtures: a tiny random model with the real SmolLM2 tokenizer, a real engine process,
and gateways on loopback over real SQLite files."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    "tests.support.workers",  # under pytest-xdist (make test: -n 2): one torch thread per worker
    "tests.support.skips",  # a skip not in its MAY_SKIP list fails the run (hardware/cluster/service only)
    "tests.support.engine_fixtures",
    "tests.support.store_fixtures",
    "tests.support.run_fixtures",
]  # engine_*, store_*/pg_*, fixture_run

from harnessrl.gateway.app import GatewayConfig, create_app  # noqa: E402
from harnessrl.gateway.http import TimedHttpProtocol  # noqa: E402
from harnessrl.services import Service, free_port, start_engine  # noqa: E402
from harnessrl.store import SQLiteStore  # noqa: E402
from tests.support.gateway import GatewayHandle, ThreadServer  # noqa: E402

if TYPE_CHECKING:
    pass


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny Llama with SmolLM2's real tokenizer."""
    from harnessrl.modeling.loading import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def smollm2_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct (fp32), converted from the packaged GGUF on first use (~30 s),
    so a fresh clone runs the real-model tests instead of skipping them."""
    from harnessrl.modeling.loading import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real builtin engine process serving the tiny model."""
    svc = start_engine(tiny_model_dir, free_port(), tmp_path_factory.mktemp("engine-logs"), 16, 2048, 1)
    try:
        svc.wait_healthy(300)  # a busy machine took over 120 s to load the tiny model
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def make_gateway(tmp_path: Path, engine: Service) -> Iterator[Callable[..., GatewayHandle]]:
    """Factory for gateways in this process over a fresh SQLite store, upstream = the engine."""
    servers: list[ThreadServer] = []

    def make(**overrides: object) -> GatewayHandle:
        admin_key = "admin-" + secrets.token_hex(8)
        store = SQLiteStore(tmp_path / f"store-{len(servers)}.sqlite")
        http = overrides.pop("http", TimedHttpProtocol)  # "h11": served by uvicorn's own protocol
        cfg = GatewayConfig.model_validate({"admin_key": admin_key, "upstream_url": engine.url, **overrides})
        srv = ThreadServer(create_app(cfg, store), http=http).__enter__()  # type: ignore[arg-type]
        servers.append(srv)
        return GatewayHandle(srv.url, admin_key, store, engine.url)

    yield make
    for s in servers:
        s.__exit__()
