"""`harnessrl sft` on the traces of a run made against another server: a scripted teacher upstream (real
HTTP on loopback, answering in vLLM's wire with the token IDs of another tokenizer, Qwen3's) behind a
real gateway and store, driven by the official OpenAI SDK. The student (a tiny model with SmolLM2's
tokenizer) re-renders the calls with its own template, text-level; its loss falls and the logprob of the
teacher's answers rises."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from harnessrl.chat import render_chat
from harnessrl.cli import main
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.engine_client.inference import TitoTokenizer
from harnessrl.modeling.loading import load_model, load_tokenizer
from harnessrl.store import SQLiteStore
from harnessrl.trainer.sft_data import load_details, sft_rows
from tests.support.families import TOKENIZERS
from tests.support.gateway import ThreadServer

# what the scripted teacher answers to the last user message
SCRIPT = {"What is 2+3?": "Let me add them.", "Go on.": "2+3 = 5.", "What is 4+4?": "It is 9."}


def scripted_teacher(tok: Tokenizer) -> Starlette:
    """A chat server in vLLM's wire (`return_token_ids`): prompt and answer tokens of `tok`."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        assert body["return_token_ids"] is True and body["logprobs"] is True
        text = SCRIPT[body["messages"][-1]["content"]]
        prompt = tok.encode(render_chat(body["messages"]), add_special_tokens=False).ids
        ids = tok.encode(text + "<|im_end|>", add_special_tokens=False).ids
        return JSONResponse({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "token_ids": ids, "logprobs": {"content": [
                             {"token": tok.id_to_token(i), "logprob": -0.25, "top_logprobs": []} for i in ids]}}],
            "prompt_token_ids": prompt,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
        })  # fmt: skip

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def record_teacher_run(run_dir: Path, upstream_url: str) -> None:
    """Three rollouts through a gateway over the scripted teacher: a two-call one graded 1, a one-call
    one graded 0, and an evaluation rollout graded 1 (never trained on)."""
    run_dir.mkdir()
    admin = "admin-" + secrets.token_hex(8)
    store = SQLiteStore(run_dir / "store.sqlite")
    cfg = GatewayConfig.model_validate({"admin_key": admin, "upstream_url": upstream_url})
    conversations: list[tuple[list[str], float, dict[str, Any]]] = [
        (["What is 2+3?", "Go on."], 1.0, {}), (["What is 4+4?"], 0.0, {}), (["What is 2+3?"], 1.0, {"eval": "x"}),
    ]  # fmt: skip
    with (
        ThreadServer(create_app(cfg, store)) as gw,
        httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {admin}"}) as control,
    ):
        for n, (turns, reward, metadata) in enumerate(conversations):
            r = control.post(
                "/control/rollouts", json={"client_id": f"c{n}", "task_id": "t", "metadata": metadata}
            )
            rid, key = r.json()["rollout"]["rollout_id"], r.json()["api_key"]
            control.post(f"/control/rollouts/{rid}/attempts").raise_for_status()
            client = OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You add numbers."}]
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                out = client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
                messages.append({"role": "assistant", "content": out.choices[0].message.content})
            control.post(
                f"/control/rollouts/{rid}/attempts/1/finish", json={"status": "exited", "exit_code": 0}
            )
            control.post(f"/control/rollouts/{rid}/state", json={"state": "succeeded"}).raise_for_status()
            control.put(f"/control/rollouts/{rid}/reward", json={"value": reward}).raise_for_status()
    store.close()


@pytest.fixture
def teacher_run(tmp_path: Path) -> Path:
    if not (TOKENIZERS / "qwen3" / "tokenizer.json").is_file():
        pytest.skip("Qwen3's tokenizer is not in .cache/tokenizers (make install)")
    qwen = Tokenizer.from_file(str(TOKENIZERS / "qwen3" / "tokenizer.json"))
    with ThreadServer(scripted_teacher(qwen)) as upstream:
        record_teacher_run(tmp_path / "teacher", upstream.url)
    return tmp_path / "teacher"


def test_sft_rows_retemplate_another_models_calls_text_level(teacher_run: Path, tiny_model_dir: Path) -> None:
    details = load_details(teacher_run)
    assert len(details) == 3 and all(c.prompt_ids for d in details for c in d.calls)  # Qwen3's IDs recorded
    tok = TitoTokenizer.from_dir(str(tiny_model_dir))
    rows, report = sft_rows(details, tok, min_reward=0.5)
    assert (report.kept, report.below_min_reward, report.eval_rollouts, report.retemplated) == (1, 1, 1, 1)
    assert len(rows) == 1 and report.calls == 2  # two calls, merged into one row in the student's tokens
    smol = load_tokenizer(tiny_model_dir)
    row = rows[0]
    answers = smol.decode(
        [t for t, m in zip(row.tokens, row.loss_mask, strict=True) if m], skip_special_tokens=False
    )
    assert answers == "Let me add them.<|im_end|>2+3 = 5.<|im_end|>"  # loss on the assistant tokens only
    full = render_chat([{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2+3?"},
                        {"role": "assistant", "content": "Let me add them."}, {"role": "user", "content": "Go on."},
                        {"role": "assistant", "content": "2+3 = 5."}], add_generation_prompt=False)  # fmt: skip
    assert smol.decode(row.tokens, skip_special_tokens=False) == full.removesuffix("\n")
    never, _ = sft_rows(
        details, tok, min_reward=0.5, retemplate="never"
    )  # the recorded (Qwen3) IDs as they are
    assert never[0].tokens != row.tokens


def test_harnessrl_sft_lowers_the_loss_and_writes_a_checkpoint(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\ntrain: {{lr: 0.003, seed: 1}}\n"
                      "sft: {min_reward: 0.5, epochs: 6, batch_rows: 1}\n")  # fmt: skip
    out = tmp_path / "sft-run"
    assert main(["sft", "--config", str(config), "--from", str(teacher_run), f"run_dir={out}"]) == 0
    summary = json.loads((out / "sft.json").read_text())
    assert summary["steps"] == 6 and summary["rows"] == 1
    assert summary["target_logprob_after"] > summary["target_logprob_before"] + 1.0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    assert load_model(Path(summary["checkpoint"])) is not None  # an HF folder: eval, export and RL start here
    assert "re-rendered with the student's template" in capsys.readouterr().out
    assert (
        main(["sft", "--config", str(config), "--from", str(tmp_path / "nowhere"), f"run_dir={out}-2"]) == 2
    )


def test_train_algorithm_sft_runs_sft_on_its_source_and_refuses_a_config_without_one(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\ntrain: {{lr: 0.003, seed: 1, algorithm: sft}}\n"
                      f"sft: {{min_reward: 0.5, epochs: 2, batch_rows: 1, source: {teacher_run}}}\n")  # fmt: skip
    out = tmp_path / "sft-by-train"
    assert main(["train", "--config", str(config), f"run_dir={out}"]) == 0  # no harness or grader needed
    summary = json.loads((out / "sft.json").read_text())
    assert summary["source"] == str(teacher_run) and summary["steps"] == 2 and summary["rows"] == 1
    assert Path(summary["checkpoint"]).name == "step-2" and "checkpoint:" in capsys.readouterr().out
    assert main(["train", "--config", str(config), "sft.source=null", f"run_dir={out}-2"]) == 2
    err = capsys.readouterr().err
    assert (
        "train.algorithm: sft" in err
        and "set sft.source" in err
        and not (tmp_path / "sft-by-train-2").exists()
    )
