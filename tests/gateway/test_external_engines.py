"""vLLM's and SGLang's wire formats behind the gateway.

Neither server runs without a GPU, so: (1) the translation is checked on bodies transcribed from their
source (tests/fixtures, see its README), and (2) the gateway is run against fake servers that re-shape
a real tiny builtin engine's answers into vLLM's and SGLang's formats, so every token ID is real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from harnessrl.gateway.engine_client import sglang
from harnessrl.gateway.engine_client.upstream import UpstreamClientError, UpstreamFailed
from harnessrl.modeling.loading import load_tokenizer
from harnessrl.services import Service
from tests.support.gateway import GatewayHandle, ThreadServer

FIXTURES = Path(__file__).parents[1] / "fixtures"
MESSAGES = [{"role": "user", "content": "Name a prime number."}]


def test_sglang_answer_becomes_a_vllm_style_completion() -> None:
    answer = json.loads((FIXTURES / "sglang_generate.json").read_text())
    out = sglang.completion_response(answer, [785, 6722, 315, 9625, 374], "m")
    choice = out["choices"][0]
    assert choice["token_ids"] == answer["output_ids"] and choice["prompt_token_ids"] == [
        785,
        6722,
        315,
        9625,
        374,
    ]
    assert choice["logprobs"]["token_logprobs"] == [
        t[0] for t in answer["meta_info"]["output_token_logprobs"]
    ]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert out["weight_version"] is None  # SGLang's default version is the string "default"
    answer["meta_info"].update(finish_reason={"type": "stop", "matched": 2}, weight_version="7")
    out = sglang.completion_response(answer, [1], "m")
    assert (out["choices"][0]["finish_reason"], out["choices"][0]["stop_reason"], out["weight_version"]) == (
        "stop",
        2,
        7,
    )
    answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "client disconnected"}
    with pytest.raises(UpstreamFailed, match="aborted"):
        sglang.completion_response(answer, [1], "m")
    with pytest.raises(UpstreamClientError):
        sglang.generate_body({"prompt": "text is not enough", "max_tokens": 3})
    body = sglang.generate_body(
        {"prompt": [1, 2], "max_tokens": 3, "temperature": 0.5, "stop_token_ids": [2], "top_p": None}
    )
    assert body == {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -1,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "stop_token_ids": [2]}}  # fmt: skip


def test_sglang_cumulative_and_incremental_streams_give_the_same_deltas() -> None:
    triples = [[-0.5, 10, None], [-0.25, 11, None], [-1.0, 12, None]]
    texts = ["a", "ab", "abc"]

    def cumulative() -> list[dict[str, Any]]:
        return [{"text": texts[i], "output_ids": [10, 11, 12][: i + 1],
                 "meta_info": {"id": "x", "output_token_logprobs": triples[: i + 1],
                               "finish_reason": {"type": "length", "length": 3} if i == 2 else None}}
                for i in range(3)]  # fmt: skip

    def incremental() -> list[dict[str, Any]]:
        return [{"text": "abc"[i], "output_ids": [[10, 11, 12][i]],
                 "meta_info": {"id": "x", "output_token_logprobs": [triples[i]],
                               "finish_reason": {"type": "length", "length": 3} if i == 2 else None}}
                for i in range(3)]  # fmt: skip

    async def collect(events: list[dict[str, Any]], inc: bool) -> list[dict[str, Any]]:
        async def gen() -> AsyncIterator[dict[str, Any]]:
            for e in events:
                yield e

        return [c async for c in sglang.delta_events(gen(), [1, 2], "m", inc)]

    for chunks in (asyncio.run(collect(cumulative(), False)), asyncio.run(collect(incremental(), True))):
        assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c"]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [10, 11, 12]
        assert [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]] == [
            -0.5,
            -0.25,
            -1.0,
        ]
        assert (
            chunks[0]["choices"][0]["prompt_token_ids"] == [1, 2]
            and chunks[-1]["choices"][0]["finish_reason"] == "length"
        )


# --- fake servers over a real engine ---------------------------------------------------------------------


async def _engine_events(client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def fake_sglang(engine_url: str, weight_version: str) -> Starlette:
    """SGLang's `/generate` wire (cumulative streaming) over the builtin engine's completions."""
    client = httpx.AsyncClient(base_url=engine_url, timeout=60)

    def meta(
        rid: str, finish: str | None, stop: Any, n_prompt: int, ids: list[int], lps: list[float]
    ) -> dict[str, Any]:
        reason = None
        if finish == "length":
            reason = {"type": "length", "length": len(ids)}
        elif finish == "stop":
            reason = {"type": "stop", "matched": stop}
        return {"id": rid, "finish_reason": reason, "prompt_tokens": n_prompt, "weight_version": weight_version,
                "completion_tokens": len(ids), "cached_tokens": 0,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]}  # fmt: skip

    async def generate(request: Request) -> Response:
        req = await request.json()
        sp = req["sampling_params"]
        body = {"prompt": req["input_ids"], "max_tokens": sp.get("max_new_tokens", 128), "logprobs": 1,
                "return_token_ids": True, **{k: sp[k] for k in ("temperature", "top_p", "top_k", "stop",
                                                                "stop_token_ids", "ignore_eos") if k in sp}}  # fmt: skip
        assert req["return_logprob"] is True
        if not req.get("stream"):
            out = (await client.post("/v1/completions", json=body)).json()
            c = out["choices"][0]
            m = meta("r1", c["finish_reason"], c["stop_reason"], len(req["input_ids"]), c["token_ids"],
                     c["logprobs"]["token_logprobs"])  # fmt: skip
            return JSONResponse({"text": c["text"], "output_ids": c["token_ids"], "meta_info": m})

        async def events() -> AsyncIterator[str]:
            text, ids, lps = "", [], []  # type: ignore[var-annotated]
            async for chunk in _engine_events(client, {**body, "stream": True}):
                c = chunk["choices"][0]
                text, ids = text + c["text"], ids + c["token_ids"]
                lps += (c.get("logprobs") or {}).get("token_logprobs") or []
                m = meta("r1", c["finish_reason"], c.get("stop_reason"), len(req["input_ids"]), ids, lps)
                yield f"data: {json.dumps({'text': text, 'output_ids': ids, 'meta_info': m})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


def fake_vllm(engine_url: str) -> Starlette:
    """vLLM's `/v1/completions` wire: prompt IDs inside the choice, no weight_version, nulls kept."""
    client = httpx.AsyncClient(base_url=engine_url, timeout=60)

    def reshape(out: dict[str, Any], first: bool) -> dict[str, Any]:
        prompt = out.pop("prompt_token_ids", None)
        out.pop("weight_version", None)
        for c in out.get("choices", []):
            c["prompt_token_ids"] = prompt if first else None
            c.setdefault("stop_reason", None)
        out.update(service_tier=None, system_fingerprint=None, kv_transfer_params=None)
        return out

    async def completions(request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse(reshape((await client.post("/v1/completions", json=body)).json(), True))

        async def events() -> AsyncIterator[str]:
            first = True
            async for chunk in _engine_events(client, body):
                yield f"data: {json.dumps(reshape(chunk, first))}\n\n"
                first = False
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_gateway_records_exact_tokens_through_external_engine_wires(
    kind: str, engine: Service, tiny_model_dir: Path, make_gateway: Callable[..., GatewayHandle]
) -> None:
    app = fake_sglang(engine.url, "3") if kind == "sglang" else fake_vllm(engine.url)
    with ThreadServer(app) as fake:
        extra = {"upstream_kind": "sglang"} if kind == "sglang" else {}
        gw = make_gateway(upstream_url=fake.url, mode="tito", tokenizer_path=str(tiny_model_dir), **extra)
        rid, key = gw.new_rollout(sampling={"temperature": 1.0, "seed": 5})  # same tokens every run
        client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
        plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10)  # type: ignore[arg-type]
        chunks = list(
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, stream=True)
        )  # type: ignore[arg-type]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = gw.store.calls(rid)
    assert len(calls) == 2 and all(c.status == "ok" for c in calls)
    tok = load_tokenizer(tiny_model_dir)
    rendered = httpx.post(f"{engine.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    for call, content in zip(calls, [plain.choices[0].message.content or "", streamed], strict=True):
        assert call.prompt_ids == rendered
        assert len(call.completion_ids) == len(call.completion_logprobs) > 0
        # the answer's text leaves special tokens out (a random model samples <|endoftext|> at times)
        decoded = tok.decode(call.completion_ids, skip_special_tokens=True)
        assert decoded.startswith(content), (decoded, content, call.completion_ids)
        assert call.weight_version == (3 if kind == "sglang" else None)  # vLLM sends none: the gateway's own


# --- admin routes (weight loads, versions, sleep) ---------------------------------------------------------


def admin_fake(answers: dict[str, tuple[int, Any]]) -> tuple[Starlette, list[str]]:
    """A server answering `answers[path] = (status, json)` and logging `METHOD path?query body`."""
    hits: list[str] = []

    async def any_route(request: Request) -> Response:
        raw = (await request.body()).decode()
        query = f"?{request.url.query}" if request.url.query else ""
        hits.append(f"{request.method} {request.url.path}{query} {raw}".strip())
        status, body = answers.get(request.url.path, (404, {"detail": "Not Found"}))
        return JSONResponse(body, status_code=status)

    return Starlette(routes=[Route("/{path:path}", any_route, methods=["GET", "POST"])]), hits


def test_vllm_admin_pauses_reloads_resets_tags_and_resumes(tmp_path: Path) -> None:
    from harnessrl.modeling.loading import make_tiny_model_dir
    from harnessrl.trainer.weights import engine_admin

    weights = make_tiny_model_dir(tmp_path / "v5")  # tied: the admin adds lm_head.safetensors first
    ok: tuple[int, Any] = (200, {})
    answers = {"/pause": (200, {"status": "paused"}), "/resume": (200, {"status": "resumed"}),
               "/collective_rpc": (200, {"results": [None]}), "/reset_prefix_cache": ok,
               "/update_weight_version": (200, {"success": True}),
               "/weight_info": (200, {"weight_version": "5"}), "/sleep": ok, "/wake_up": ok}  # fmt: skip
    app, hits = admin_fake(answers)

    async def drive(url: str) -> int:
        admin = engine_admin("vllm", url)
        assert await admin.load_weights(weights, 5) == 5
        await admin.sleep()
        await admin.wake_up()
        version = await admin.weight_version()
        await admin.aclose()
        return version

    with ThreadServer(app) as srv:
        assert asyncio.run(drive(srv.url)) == 5
    rpc = json.dumps({"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}).replace(" ", "")
    assert [h.replace(" ", "") for h in hits] == [
        "POST/pause?mode=wait", f"POST/collective_rpc{rpc}", "POST/reset_prefix_cache",
        'POST/update_weight_version{"new_version":"5"}', "POST/resume", "GET/weight_info",
        "POST/sleep?level=1", "POST/wake_up", "GET/weight_info",
    ]  # fmt: skip
    from safetensors.torch import load_file

    head = load_file(str(weights / "lm_head.safetensors"))["lm_head.weight"]
    embed = load_file(str(weights / "model.safetensors"))["model.embed_tokens.weight"]
    assert head.equal(embed)


def test_vllm_admin_resumes_even_when_the_load_fails(tmp_path: Path) -> None:
    from harnessrl.trainer.weights import EngineAdminError, engine_admin

    app, hits = admin_fake({"/pause": (200, {}), "/resume": (200, {}),
                            "/collective_rpc": (500, {"error": "no such file"})})  # fmt: skip
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')

    async def drive(url: str) -> None:
        admin = engine_admin("vllm", url)
        try:
            await admin.load_weights(tmp_path, 1)
        finally:
            await admin.aclose()

    with ThreadServer(app) as srv, pytest.raises(EngineAdminError, match="collective_rpc answered 500"):
        asyncio.run(drive(srv.url))
    assert hits[-1].startswith("POST /resume")  # never left paused


def test_vllm_admin_falls_back_to_restart_when_the_reload_fails(tmp_path: Path) -> None:
    from harnessrl.trainer.weights import engine_admin

    app, hits = admin_fake({"/pause": (200, {}), "/resume": (200, {}), "/collective_rpc": (404, {}),
                            "/update_weight_version": (200, {}), "/weight_info": (200, {"weight_version": "2"})})  # fmt: skip
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    restarted: list[Path] = []

    async def restart(path: Path) -> float:
        restarted.append(path)
        return 0.0

    async def drive(url: str) -> int:
        admin = engine_admin("vllm", url, restart=restart)
        try:
            v = await admin.load_weights(tmp_path, 2)
            assert [s["method"] for s in admin.syncs] == ["restart"]  # type: ignore[attr-defined]
            return v
        finally:
            await admin.aclose()

    with ThreadServer(app) as srv:
        assert asyncio.run(drive(srv.url)) == 2
    assert restarted == [tmp_path]
    assert [h.split(" ")[1] for h in hits][-3:] == ["/resume", "/update_weight_version", "/weight_info"]


def test_sglang_admin_loads_from_disk_and_reads_the_version(tmp_path: Path) -> None:
    from harnessrl.trainer.weights import EngineAdminError, engine_admin

    answers = {"/update_weights_from_disk": (200, {"success": True, "message": "ok", "num_paused_requests": 0}),
               "/get_model_info": (200, {"model_path": "m", "weight_version": "2"}),
               "/release_memory_occupation": (200, None), "/resume_memory_occupation": (200, None)}  # fmt: skip
    app, hits = admin_fake(answers)

    async def drive(url: str) -> int:
        admin = engine_admin("sglang", url)
        assert await admin.load_weights(tmp_path / "v2", 2) == 2
        await admin.sleep()
        await admin.wake_up()
        version = await admin.weight_version()  # /model_info is 404 here: the older route answers
        await admin.aclose()
        return version

    with ThreadServer(app) as srv:
        assert asyncio.run(drive(srv.url)) == 2
    assert (
        hits[0] == f'POST /update_weights_from_disk {{"model_path":"{tmp_path / "v2"}","weight_version":"2"}}'
    )
    assert [h.split(" ")[1] for h in hits[1:]] == ["/release_memory_occupation", "/resume_memory_occupation",
                                                   "/model_info", "/get_model_info"]  # fmt: skip
    failing, _ = admin_fake({"/update_weights_from_disk": (200, {"success": False, "message": "bad shape"})})
    with ThreadServer(failing) as srv, pytest.raises(EngineAdminError, match="bad shape"):
        asyncio.run(engine_admin("sglang", srv.url).load_weights(tmp_path, 3))


def test_run_config_names_an_external_engine_by_kind_and_url() -> None:
    from harnessrl.config import load_config

    cfg = load_config(None, ["engine.kind=vllm", "engine.url=http://127.0.0.1:8000"])
    assert (cfg.engine.kind, cfg.engine.url) == ("vllm", "http://127.0.0.1:8000")
    with pytest.raises(Exception, match=r"needs engine\.url"):
        load_config(None, ["engine.kind=sglang"])
    assert load_config(None, ["engine.kind=vllm"]).engine.url is None  # managed: the run starts vLLM
    from harnessrl.services.stack import gateway_mode

    # vLLM's chat template for SmolLM2 has no tools: the gateway renders (tito) unless told otherwise
    assert gateway_mode(load_config(None, ["engine.kind=vllm"])) == "tito"
    assert gateway_mode(load_config(None, ["engine.kind=vllm", "gateway.mode=passthrough"])) == "passthrough"
    assert gateway_mode(load_config(None, [])) == "passthrough"
    with pytest.raises(Exception, match=r"needs a managed vLLM"):
        load_config(None, ["engine.kind=vllm", "engine.url=http://x", "engine.vllm_sync=restart"])
    with pytest.raises(ValueError, match="engine kind"):
        from harnessrl.trainer.weights import engine_admin

        engine_admin("tgi", "http://x")


def test_managed_vllm_without_its_venv_says_how_to_install(tmp_path: Path) -> None:
    from harnessrl.services.vllm import VLLMNotInstalled, find_vllm_python

    with pytest.raises(VLLMNotInstalled, match=r"is not an interpreter.*make install-vllm"):
        find_vllm_python(str(tmp_path / "missing" / "python"))


def test_untied_view_links_the_files_and_copies_the_embeddings_as_lm_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from harnessrl.modeling.loading import make_tiny_model_dir
    from harnessrl.services.vllm import LM_HEAD_FILE, ManagedVLLM, VLLMSettings, untied_model_dir

    src = make_tiny_model_dir(tmp_path / "m")
    out = untied_model_dir(src, tmp_path / "view")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert (out / "model.safetensors").is_symlink() and (out / "tokenizer.json").is_symlink()
    head = load_file(str(out / LM_HEAD_FILE))["lm_head.weight"]
    assert head.equal(load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"])
    weights = tmp_path / "weights"  # a trainer's weight directory: no tokenizer, linked from the model
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights / name).write_bytes((src / name).read_bytes())
    again = untied_model_dir(weights, tmp_path / "view", tokenizer_dir=src)
    assert (again / "tokenizer.json").resolve() == (src / "tokenizer.json").resolve()
    server = ManagedVLLM(
        VLLMSettings(python=Path("/x/python"), dtype="bfloat16", threads=2), out, 8123, tmp_path
    )
    args = server.args()
    assert args[0] == "vllm.entrypoints.openai.api_server" and args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--served-model-name") + 1] == "smollm2"
    env = server.env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_reward_curve_survives_an_interval_that_misses_zero_by_rounding(tmp_path: Path) -> None:
    from harnessrl.runs.plot import reward_curve

    metrics = tmp_path / "metrics.jsonl"  # the vLLM smoke run's numbers: 0/4 rewarded, lo = 1e-17
    metrics.write_text(
        json.dumps({"step": 1, "reward": 0.0, "heldout_reward": 0.0, "heldout_ci95": [1e-17, 0.49]})
    )
    r = {"mean": 0.0, "ci95": [1e-17, 0.49]}
    summary = {"train_steps": 1, "heldout_by_temperature": {"0": {"before": r, "after": r}}}
    assert reward_curve(metrics, summary, tmp_path / "curve.png") is not None
    assert (tmp_path / "curve.png").stat().st_size > 0
