"""Hot weight reload, pause/resume and EOS handling, each on its own engine (they change its state)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from harnessrl.engine.detok import TokenText
from harnessrl.engine.sampling import SamplingParams
from harnessrl.engine.scheduler import Scheduler
from harnessrl.engine.sequence import EngineSequence, GenerationResult
from harnessrl.engine.server import ServerThread
from harnessrl.modeling.loading import load_model, load_tokenizer
from tests.support.engine_server import full_forward_logprobs, start_server, tiny_dir

LONG = {"max_tokens": 300, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model (other seed): the 'trained' weights to load."""
    return tiny_dir(tmp_path_factory.getbasetemp() / "engine-models", seed=1)


@pytest.fixture(scope="module")
def reload_server(engine_tiny_dir: Path) -> ServerThread:
    """An engine of its own, since these tests swap its weights."""
    return start_server(engine_tiny_dir, "reload")


async def _load_during_generation(server: ServerThread, weights: Path) -> tuple[list[Any], Any, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        prompts = [[1, 4093, 198, 300 + i, 301 + i] for i in range(3)]
        running = [
            asyncio.create_task(client.post("/v1/completions", json={"prompt": p, "seed": i, **LONG}))
            for i, p in enumerate(prompts)
        ]
        while (await client.get("/admin/stats")).json()["running"] < len(prompts):
            await asyncio.sleep(0.005)
        load = asyncio.create_task(
            client.post("/admin/load_weights", json={"path": str(weights), "version": 7})
        )
        while (await client.get("/admin/stats")).json()["pending_weight_loads"] == 0 and not load.done():
            await asyncio.sleep(0.005)
        # Submitted while the load is pending: must wait and be served by the new weights.
        late = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": prompts[0], "seed": 0, **LONG})
        )
        done = await asyncio.gather(*running)
        return [r.json() for r in done], (await load).json(), (await late).json()


def test_load_weights_waits_for_running_sequences(
    reload_server: ServerThread, new_weights_dir: Path, engine_tiny_dir: Path
) -> None:
    old_model, new_model = load_model(engine_tiny_dir), load_model(new_weights_dir)
    before, load, late = asyncio.run(_load_during_generation(reload_server, new_weights_dir))
    assert load == {"weight_version": 7}
    for res in before:  # in flight during the load: entirely old weights
        assert res["weight_version"] == 0 and res["choices"][0]["finish_reason"] == "length"
        _assert_exact(old_model, res)
    assert late["weight_version"] == 7
    _assert_exact(new_model, late)
    assert late["choices"][0]["token_ids"] != before[0]["choices"][0]["token_ids"]  # same seed, new weights
    assert httpx.get(reload_server.url + "/admin/weight_version").json() == {"weight_version": 7}


def _assert_exact(model: torch.nn.Module, res: dict[str, Any]) -> None:
    choice = res["choices"][0]
    reported = torch.tensor(choice["logprobs"]["token_logprobs"])
    recomputed = full_forward_logprobs(model, res["prompt_token_ids"], choice["token_ids"], 1.0)  # type: ignore[arg-type]
    assert (reported - recomputed).abs().max().item() < 1e-4


def test_load_weights_from_a_safetensors_file_bumps_version(
    reload_server: ServerThread, engine_tiny_dir: Path
) -> None:
    r = httpx.post(
        reload_server.url + "/admin/load_weights",
        json={"path": str(engine_tiny_dir / "model.safetensors"), "version": 8},
        timeout=60,
    )
    assert r.json() == {"weight_version": 8}
    res = httpx.post(
        reload_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    ).json()
    assert res["weight_version"] == 8


def test_pause_holds_new_requests_until_resume(reload_server: ServerThread) -> None:
    url = reload_server.url
    httpx.post(url + "/admin/pause")
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.update(
            httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).json()
        )
    )
    t.start()
    while httpx.get(url + "/admin/stats").json()["waiting"] < 1:
        time.sleep(0.005)
    assert httpx.get(url + "/admin/stats").json()["paused"] is True and not out
    httpx.post(url + "/admin/resume")
    t.join(60)
    assert out["choices"][0]["finish_reason"] == "length"


def _run_scheduler(
    model_dir: Path, seq_params: SamplingParams, eos: set[int], prompt: list[int]
) -> GenerationResult:

    model = load_model(model_dir)
    text = TokenText(load_tokenizer(model_dir))
    sched = Scheduler(model, text, max_batch=2, max_model_len=64, eos_ids=eos)
    box: list[GenerationResult | BaseException] = []
    done = threading.Event()
    seq = EngineSequence(prompt, seq_params, lambda r: (box.append(r), done.set()), text, torch.device("cpu"))
    sched.start()
    sched.submit(seq)
    done.wait(60)
    sched.shutdown()
    assert isinstance(box[0], GenerationResult)
    return box[0]


def test_eos_is_in_token_ids_and_logprobs_not_in_text(engine_tiny_dir: Path) -> None:
    prompt = [1, 4093, 198, 520]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    free = _run_scheduler(engine_tiny_dir, greedy, set(), prompt)
    eos = free.token_ids[3]
    res = _run_scheduler(engine_tiny_dir, greedy, {eos}, prompt)
    n = free.token_ids.index(eos) + 1
    assert res.finish_reason == "stop" and res.stop_reason is None
    assert res.token_ids == free.token_ids[:n] and len(res.logprobs) == n
    text = TokenText(load_tokenizer(engine_tiny_dir))
    assert res.text == text.decode(free.token_ids[: n - 1])


def test_client_disconnect_aborts_the_sequence(reload_server: ServerThread) -> None:
    url = reload_server.url
    before = httpx.get(url + "/admin/stats").json()
    httpx.post(url + "/admin/pause")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 50}, timeout=0.5)
    time.sleep(0.6)  # the server notices the disconnect within its poll interval (0.25 s)
    httpx.post(url + "/admin/resume")
    deadline = time.monotonic() + 30
    while (
        httpx.get(url + "/admin/stats").json()["aborted"] == before["aborted"] and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    after = httpx.get(url + "/admin/stats").json()
    assert after["aborted"] == before["aborted"] + 1
    assert after["generated_tokens"] == before["generated_tokens"]


def test_sleep_frees_the_kv_cache_and_requests_wait_for_wake_up(engine_tiny_dir: Path) -> None:
    server = start_server(engine_tiny_dir, "sleepy")
    body = {"prompt": [1, 4093, 198], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[dict[str, object], dict[str, object], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            before = (await c.post("/v1/completions", json=body)).json()
            weight_bytes = (await c.get("/admin/stats")).json()["weight_bytes"]
            assert (await c.post("/admin/sleep")).json() == {"sleeping": True, "level": 1}
            stats = (await c.get("/admin/stats")).json()
            assert stats["sleeping"] and stats["kv_cache_bytes"] == 0
            assert stats["weight_bytes"] == weight_bytes > 0  # level 1 on CPU: nothing to offload to
            waiting = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # held while asleep, not failed
            t0 = time.monotonic()
            assert (await c.post("/admin/wake_up")).json() == {"sleeping": False}
            after = (await waiting).json()
            return before, after, time.monotonic() - t0

    before, after, _ = asyncio.run(run())
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]  # type: ignore[index]
    stats = httpx.get(server.url + "/admin/stats").json()
    assert not stats["sleeping"] and stats["kv_cache_bytes"] > 0


def test_sleep_level_2_discards_weights_until_a_load(engine_tiny_dir: Path) -> None:
    """Level 2 frees the weights too; after wake-up nothing is served until new weights are loaded (never
    a sample from empty memory), and a load while still asleep is refused."""
    server = start_server(engine_tiny_dir, "deep-sleep")
    body = {"prompt": [1, 4093, 198], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def run() -> tuple[dict[str, object], dict[str, object]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            before = (await c.post("/v1/completions", json=body)).json()
            assert (await c.post("/admin/sleep", params={"level": 3})).status_code == 400
            assert (await c.post("/admin/sleep", params={"level": 2})).json()["level"] == 2
            stats = (await c.get("/admin/stats")).json()
            assert stats["needs_weights"] and stats["kv_cache_bytes"] == 0 and stats["weight_bytes"] < 1024
            load = {"path": str(engine_tiny_dir), "version": 1}
            refused = await c.post("/admin/load_weights", json=load)
            assert refused.status_code == 409 and "wake it up" in refused.text
            await c.post("/admin/wake_up")
            waiting = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # awake, but no weights yet: held
            assert (await c.get("/admin/stats")).json()["needs_weights"]
            assert (await c.post("/admin/load_weights", json=load)).json() == {"weight_version": 1}
            after = (await waiting).json()
            stats = (await c.get("/admin/stats")).json()
            assert not stats["needs_weights"] and stats["weight_bytes"] > 1024
            return before, after

    before, after = asyncio.run(run())
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]  # type: ignore[index]
    assert after["choices"][0]["logprobs"] == before["choices"][0]["logprobs"]  # type: ignore[index]
