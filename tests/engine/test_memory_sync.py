"""The full-weight sync from memory (`engine.weight_sync: memory`): the trainer sends its tensors in the
model's dtype through a shared-memory segment (same machine) or as a safetensors body on the builtin
engine's /admin/load_weights; no folder is written, no segment is left, the engine serves the trainer's
logprobs at the new version; a bad body or segment is refused with a 400 naming it and the old weights
keep serving; an engine that cannot see the segment gets the body; asleep at level 2: 409."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch

from harnessrl.config import load_config
from harnessrl.engine.server import ServerThread
from harnessrl.errors import ConfigError
from harnessrl.modeling.loading import load_model
from harnessrl.modeling.weight_shm import SHM_DIR, shared_weights
from harnessrl.modeling.weight_stream import MEDIA_TYPE, WeightStream, sync_state
from harnessrl.trainer.weights import EngineAdmin, EngineAdminError, engine_admin, publish_weights
from tests.support.engine_server import full_forward_logprobs, start_server

PROMPT = [1, 4093, 198, 2683, 314, 253, 1345, 28, 906, 30, 2, 198]


@pytest.fixture(scope="module")
def server(engine_tiny_dir: Path) -> ServerThread:
    """An engine of its own: these tests change its weights (and put it to sleep last)."""
    return start_server(engine_tiny_dir, "memory-sync")


def _trained(model_dir: Path, dtype: torch.dtype, scale: float) -> torch.nn.Module:
    """The trainer's model in `dtype` with every weight changed (as an update would)."""
    model = load_model(model_dir, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def _generate(url: str) -> dict[str, Any]:
    body = {
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "logprobs": 0,
    }
    res: dict[str, Any] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return res


def _gap(model: torch.nn.Module, res: dict[str, Any]) -> float:
    """Largest |engine logprob - the model's own full forward| over the sampled tokens (fp32 forward)."""
    choice = res["choices"][0]
    ours = full_forward_logprobs(model.float(), res["prompt_token_ids"], choice["token_ids"], 1.0)  # type: ignore[arg-type]
    return float((torch.tensor(choice["logprobs"]["token_logprobs"]) - ours).abs().max())


async def _publish(
    url: str, model: torch.nn.Module, weights: Path, version: int, shm: bool = True, **kw: Any
) -> str:
    """publish_weights as the run calls it; returns the transport a memory sync took."""
    admin = EngineAdmin(url, **kw)
    admin.shared_memory = admin.shared_memory and shm
    try:
        await publish_weights(model, admin, weights, version)  # type: ignore[arg-type]
        return admin.transport
    finally:
        await admin.aclose()


def _segment_removed(version: int) -> bool:
    """The segment this process wrote for `version` is gone (removed on a thread: give it a moment)."""
    prefix = f"harnessrl-weights-{os.getpid()}-{version}-"
    deadline = time.monotonic() + 10
    while any(SHM_DIR.glob(prefix + "*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(SHM_DIR.glob(prefix + "*"))


def test_the_body_is_safetensors_in_the_models_dtype(engine_tiny_dir: Path) -> None:
    fp32, bf16 = (sync_state(load_model(engine_tiny_dir, dtype=d)) for d in (torch.float32, torch.bfloat16))
    assert "lm_head.weight" not in fp32  # tied: the engine fills it from the embedding
    bodies = {d: b"".join(WeightStream(s, chunk_bytes=1 << 16)) for d, s in (("f32", fp32), ("bf16", bf16))}
    for name, state in (("f32", fp32), ("bf16", bf16)):
        read = safetensors.torch.load(bodies[name])  # the official reader reads what the trainer sends
        assert read.keys() == state.keys() and all(torch.equal(read[k], v) for k, v in state.items())
    tensor_bytes = sum(t.numel() * 2 for t in bf16.values())
    assert len(bodies["bf16"]) - tensor_bytes < 4096 and len(bodies["f32"]) > 1.9 * len(bodies["bf16"])


@pytest.mark.parametrize(  # (the socket with fp32: test_an_engine_that_cannot_see_the_segment_gets_the_body)
    ("version", "dtype", "transport"),
    [(1, torch.float32, "shm"), (2, torch.bfloat16, "shm"), (3, torch.bfloat16, "socket")],
)
def test_a_memory_sync_serves_the_trainers_logprobs_and_writes_no_file(
    server: ServerThread,
    engine_tiny_dir: Path,
    tmp_path: Path,
    version: int,
    dtype: torch.dtype,
    transport: str,
) -> None:
    """fp32 and bf16 trainers (train.dtype), both transports: the engine (fp32) serves the weights sent."""
    model = _trained(engine_tiny_dir, dtype, 1.0 + 0.05 * version)
    assert (
        asyncio.run(_publish(server.url, model, tmp_path / "weights", version, shm=transport == "shm"))
        == transport
    )
    assert not (tmp_path / "weights").exists() and _segment_removed(version)
    res = _generate(server.url)
    assert res["weight_version"] == version
    assert httpx.get(f"{server.url}/admin/weight_version").json() == {"weight_version": version}
    assert _gap(model, res) < 1e-4
    assert _gap(load_model(engine_tiny_dir), res) > 1e-3  # not the weights it started with


def test_an_engine_that_cannot_see_the_segment_gets_the_body(
    server: ServerThread, engine_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As an engine in another container would: it looks in a /dev/shm of its own (here an empty folder)."""
    from harnessrl.modeling import weight_shm

    def elsewhere(name: str, check: Any) -> Any:
        return weight_shm.read_shared(name, check, shm_dir=tmp_path / "other-shm")

    monkeypatch.setattr("harnessrl.engine.core.read_shared", elsewhere)
    model = _trained(engine_tiny_dir, torch.float32, 0.9)

    async def two_syncs() -> tuple[str, bool, str]:
        admin = EngineAdmin(server.url)
        try:
            await publish_weights(model, admin, tmp_path / "weights", 5)  # type: ignore[arg-type]
            first, shm_after = admin.transport, admin.shared_memory
            await publish_weights(model, admin, tmp_path / "weights", 6)  # type: ignore[arg-type]
            return first, shm_after, admin.transport
        finally:
            await admin.aclose()

    assert asyncio.run(two_syncs()) == ("socket", False, "socket")
    res = _generate(server.url)
    assert res["weight_version"] == 6 and _gap(model, res) < 1e-4


def test_the_file_sync_stays_available(server: ServerThread, engine_tiny_dir: Path, tmp_path: Path) -> None:
    model = _trained(engine_tiny_dir, torch.float32, 0.97)
    asyncio.run(_publish(server.url, model, tmp_path / "weights", 7, weight_sync="file"))
    assert (tmp_path / "weights" / "v7" / "model.safetensors").is_file()
    res = _generate(server.url)
    assert res["weight_version"] == 7 and _gap(model, res) < 1e-4


def _post(url: str, body: Any, version: str | None = "9", chunked: bool = False) -> httpx.Response:
    params = {} if version is None else {"version": version}
    content = iter([body[:7], body[7:]]) if chunked else body  # an iterator: no Content-Length
    return httpx.post(f"{url}/admin/load_weights", params=params, content=content,
                      headers={"Content-Type": MEDIA_TYPE}, timeout=60)  # fmt: skip


def test_a_bad_body_is_refused_and_the_old_weights_keep_serving(
    server: ServerThread, engine_tiny_dir: Path
) -> None:
    _generate(server.url)  # the prompt cached, as it is for "after" (a cold prefill differs in the last bits)
    before = _generate(server.url)
    state = sync_state(_trained(engine_tiny_dir, torch.float32, 1.3))
    good = b"".join(WeightStream(state))
    wrong_shape = {**state, "model.norm.weight": torch.ones(65)}
    extra = {**state, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}
    cases = [
        (good[:-100], {}, "bytes but its header describes"),  # Content-Length says it is short
        (good[:-100], {"chunked": True}, "ended after"),  # no length: found at the end, nothing swapped
        (good + b"xx", {"chunked": True}, "longer than"),
        (b"".join(WeightStream(wrong_shape)), {}, "model.norm.weight: shape (65,)"),
        (b"".join(WeightStream(extra)), {}, "unexpected=['model.layers.9.mlp.up_proj.weight']"),
        (b"not safetensors", {}, "header"),
        (good, {"version": None}, "?version=N"),
        (good, {"version": "x"}, "?version=N"),
    ]
    for body, kw, message in cases:
        r = _post(server.url, body, **kw)
        assert r.status_code == 400, (message, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == ("version" if "version" in kw else "body")
    after = _generate(server.url)
    assert after["weight_version"] == before["weight_version"]
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]


def _post_shm(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/load_weights", json={"shm": name, "version": 9}, timeout=60)


def test_a_bad_segment_is_refused_and_the_old_weights_keep_serving(
    server: ServerThread, engine_tiny_dir: Path
) -> None:
    _generate(server.url)  # the prompt cached, as it is for "after" (a cold prefill differs in the last bits)
    before = _generate(server.url)
    state = sync_state(_trained(engine_tiny_dir, torch.float32, 1.3))
    wrong_shape = {**state, "model.norm.weight": torch.ones(65)}
    with shared_weights(WeightStream(wrong_shape), f"harnessrl-weights-test-shape-{os.getpid()}") as name:
        r = _post_shm(server.url, name)
        assert r.status_code == 400 and "model.norm.weight: shape (65,)" in r.json()["error"]["message"]
    with shared_weights(WeightStream(state), f"harnessrl-weights-test-short-{os.getpid()}") as name:
        os.truncate(SHM_DIR / name, len(WeightStream(state)) - 100)  # cut short after it was written
        r = _post_shm(server.url, name)
        assert r.status_code == 400 and "but its header describes" in r.json()["error"]["message"]
    for name, message in (
        ("harnessrl-weights-gone", "no shared-memory segment"),
        ("../etc/passwd", "must match"),
    ):
        r = _post_shm(server.url, name)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "shm"
    both = {"shm": "harnessrl-weights-x", "path": str(engine_tiny_dir), "version": 9}
    r = httpx.post(f"{server.url}/admin/load_weights", json=both, timeout=60)
    assert r.status_code == 400 and "either 'path'" in r.json()["error"]["message"]
    after = _generate(server.url)
    assert after["weight_version"] == before["weight_version"]
    assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]


def test_asleep_at_level_2_the_body_waits_for_wake_up(
    server: ServerThread, engine_tiny_dir: Path, tmp_path: Path
) -> None:
    model = _trained(engine_tiny_dir, torch.float32, 1.1)

    async def run() -> str:
        admin = EngineAdmin(server.url)
        try:
            await admin.sleep(2)
            try:
                await admin.push_weights(sync_state(model), 20)  # by shared memory: refused before reading it
                refused = ""
            except EngineAdminError as exc:
                refused = str(exc)
            await admin.wake_up()
            assert await admin.push_weights(sync_state(model), 21) == 21
            return refused
        finally:
            await admin.aclose()

    refused = asyncio.run(run())
    assert "409" in refused and "engine_asleep" in refused
    res = _generate(server.url)
    assert res["weight_version"] == 21 and _gap(model, res) < 1e-4


def test_weight_sync_setting() -> None:
    assert load_config().engine.weight_sync is None
    assert engine_admin("builtin", "http://x").weight_sync == "memory"
    assert engine_admin("vllm", "http://x").weight_sync == "file"
    assert engine_admin("builtin", "http://x", weight_sync="file").weight_sync == "file"
    assert load_config(overrides=["engine.weight_sync=file"]).engine.weight_sync == "file"
    with pytest.raises(ConfigError, match=r"engine\.weight_sync=memory needs the builtin engine"):
        load_config(overrides=["engine.kind=vllm", "engine.weight_sync=memory"])
    with pytest.raises(ValueError, match="weight_sync"):
        engine_admin("sglang", "http://x", weight_sync="memory")
