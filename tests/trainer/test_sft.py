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
import torch
from openai import OpenAI
from safetensors import safe_open
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
from harnessrl.schema import RewardIn
from harnessrl.store import SQLiteStore
from harnessrl.trainer.checkpoint import TRAINING_STATE, load_checkpoint
from harnessrl.trainer.precision import LOW_KEY, MasterAdamW, make_optimizer, master_weights
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
    assert (summary["dtype"], summary["optimizer"]) == ("float32", "AdamW")  # train.dtype's default
    assert summary["matmul"] != "aten (aten asked)"  # train.matmul: auto (its probe decides)
    assert checkpoint_dtypes(Path(summary["checkpoint"])) == {torch.float32}
    blob = torch.load(Path(summary["checkpoint"]) / TRAINING_STATE, weights_only=False)
    assert blob["optimizer"]["state"] and not any(LOW_KEY in st for st in blob["optimizer"]["state"].values())
    assert "re-rendered with the student's template" in capsys.readouterr().out
    assert (
        main(["sft", "--config", str(config), "--from", str(tmp_path / "nowhere"), f"run_dir={out}-2"]) == 2
    )


def test_train_algorithm_sft_runs_sft_on_its_source_and_refuses_a_config_without_one(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\n"
                      "train: {lr: 0.003, seed: 1, algorithm: sft, lr_schedule: cosine}\n"
                      f"sft: {{min_reward: 0.5, epochs: 2, batch_rows: 1, source: {teacher_run}}}\n")  # fmt: skip
    out = tmp_path / "sft-by-train"
    assert main(["train", "--config", str(config), f"run_dir={out}"]) == 0  # no harness or grader needed
    summary = json.loads((out / "sft.json").read_text())
    assert summary["source"] == str(teacher_run) and summary["steps"] == 2 and summary["rows"] == 1
    assert Path(summary["checkpoint"]).name == "step-2" and "checkpoint:" in capsys.readouterr().out
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.003, 0.0015])  # cosine over the 2 SFT steps: 1, then (1 + cos(π/2)) / 2
    blob = torch.load(Path(summary["checkpoint"]) / TRAINING_STATE, weights_only=False)
    assert blob["scheduler"]["last_epoch"] == 2  # saved as RL saves it: a resume continues the schedule
    assert main(["train", "--config", str(config), f"run_dir={out}", "--resume"]) == 0  # done: nothing more
    again = json.loads((out / "sft.json").read_text())
    assert (again["steps"], again["resumed_from_step"]) == (
        2,
        2,
    ) and "resumed from step 2" in capsys.readouterr().out
    assert main(["train", "--config", str(config), "sft.source=null", f"run_dir={out}-2"]) == 2
    err = capsys.readouterr().err
    assert (
        "train.algorithm: sft" in err
        and "set sft.source" in err
        and not (tmp_path / "sft-by-train-2").exists()
    )


def checkpoint_dtypes(ckpt: Path) -> set[torch.dtype]:
    """The dtypes of the weights a checkpoint folder holds (model.safetensors)."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def test_sft_in_bf16_trains_bf16_parameters_with_master_adamw_and_rl_continues_from_its_checkpoint(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.dtype, train.exp_avg_dtype and train.matmul are the RL trainer's: bf16 parameters, MasterAdamW
    with a bf16 first moment, the matmul asked for; the checkpoint is what RL writes for a bf16 model."""
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\n"
                      "train: {lr: 0.003, seed: 1, dtype: bfloat16, exp_avg_dtype: bfloat16, matmul: aten}\n"
                      "sft: {min_reward: 0.5, epochs: 6, batch_rows: 1}\n")  # fmt: skip
    out = tmp_path / "sft-bf16"
    assert main(["sft", "--config", str(config), "--from", str(teacher_run), f"run_dir={out}"]) == 0
    summary = json.loads((out / "sft.json").read_text())
    assert (summary["dtype"], summary["exp_avg_dtype"], summary["optimizer"], summary["matmul"]) == (
        "bfloat16", "bfloat16", "MasterAdamW", "aten (aten asked)"
    )  # fmt: skip
    assert "in bfloat16 (MasterAdamW" in capsys.readouterr().out
    assert summary["steps"] == 6 and summary["target_logprob_after"] > summary["target_logprob_before"] + 1.0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    ckpt = Path(summary["checkpoint"])
    assert checkpoint_dtypes(ckpt) == {torch.bfloat16}  # the parameters as trained, as RL saves them
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "bfloat16"
    states = torch.load(ckpt / TRAINING_STATE, weights_only=False)["optimizer"]["state"].values()
    assert states and all(
        (st[LOW_KEY].dtype, st["exp_avg"].dtype, st["exp_avg_sq"].dtype)
        == (torch.int16, torch.bfloat16, torch.float32)
        for st in states
    )  # MasterAdamW's state: the low halves of the fp32 masters, the first moment in bf16
    # RL from it: its trainer's bf16 model and optimizer take the weights and the exact fp32 masters
    model = load_model(ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    optimizer = make_optimizer(model.parameters(), torch.bfloat16, 0.003, 0.0, "bfloat16")
    assert isinstance(optimizer, MasterAdamW)
    assert load_checkpoint(ckpt, model, optimizer)["sft"] is True
    p = model.model.embed_tokens.weight
    assert not torch.equal(master_weights(optimizer, p), p.float())  # fp32 bits beyond bf16, restored
    assert load_model(ckpt) is not None  # and in fp32, as `harnessrl eval --model` and the engine read it


@pytest.mark.parametrize(
    ("override", "field"),
    [("train.world_size=2", "train.world_size"), ("train.lora={}", "train.lora"),
     ("train.moe_aux_loss_coef=0.01", "train.moe_aux_loss_coef")],
)  # fmt: skip
def test_sft_refuses_the_settings_it_cannot_honour_by_name(
    override: str, field: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\n")
    source = tmp_path / "traces.jsonl"  # never read: the refusal comes first
    out = tmp_path / "sft-run"
    assert main(["sft", "--config", str(config), "--from", str(source), f"run_dir={out}", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harnessrl sft: {field}") and "SFT" in err and not out.exists()
    algorithm = ["train.algorithm=sft", f"sft.source={source}", f"run_dir={out}", override]
    assert main(["train", "--config", str(config), *algorithm]) == 2  # refused when the config is loaded
    assert field in capsys.readouterr().err and not out.exists()
    assert main(["sft", "--config", str(config), "--from", str(source), f"run_dir={out}"]) == 2
    assert "no such" in capsys.readouterr().err.lower()  # without the override: on to the (missing) source


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder's model.safetensors."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def test_sft_checkpoints_every_n_steps_keeps_the_newest_and_logs_to_the_trackers_of_log_to(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """train.checkpoint_every, train.keep_checkpoints and train.log_to as the RL loop honours them: a
    checkpoint after steps 2 and 4 and the last (5), the older pruned to 2; every step's metrics in
    MLflow's file store, and no TensorBoard (the default) since log_to does not name it."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from harnessrl.config import load_config
    from harnessrl.trainer.sft import run_sft

    config = tmp_path / "config.yaml"
    config.write_text(f"name: sft-trackers\nengine: {{model: {tiny_model_dir}}}\n"
                      "train: {lr: 0.003, seed: 1, checkpoint_every: 2, keep_checkpoints: 2, log_to: [mlflow]}\n"
                      f"sft: {{min_reward: 0.5, epochs: 5, batch_rows: 1, source: {teacher_run}}}\n")  # fmt: skip
    out = tmp_path / "sft-ckpts"
    cfg = load_config(config, [f"run_dir={out}"])
    seen: list[tuple[int, str | None, list[str]]] = []

    def on_step(step: int, total: int, m: dict[str, Any]) -> None:
        kept = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        saved = Path(m["checkpoint"]).name if "checkpoint" in m else None
        seen.append((step, saved, [p.name for p in kept]))
        assert total == 5

    summary = run_sft(cfg, on_step=on_step)
    assert seen == [
        (1, None, []),
        (2, "step-2", ["step-2"]),
        (3, None, ["step-2"]),
        (4, "step-4", ["step-2", "step-4"]),
        (5, "step-5", ["step-4", "step-5"]),  # step-2 pruned: keep_checkpoints 2
    ]
    assert Path(summary["checkpoint"]) == out / "checkpoints" / "step-5" and not summary["stopped_early"]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "sft-trackers"]
    (run,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(n, pytest.approx(v)) for n, v in enumerate(losses, 1)]
    assert {"target_logprob", "lr", "grad_norm"} <= set(run.data.metrics) and run.info.status == "FINISHED"
    assert not (out / "tensorboard").exists()  # log_to: [mlflow] only


def test_sft_stops_at_its_time_budget_with_a_checkpoint_and_resume_finishes_as_one_run_would(
    teacher_run: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.time_budget_s: the run stops after the step during which it ran out (here the first), saves
    that step (even with checkpoint_every 0) and says so; --resume continues from the checkpoint with
    the optimizer and LR schedule restored: the same losses and weights as one uninterrupted run."""
    config = tmp_path / "config.yaml"
    config.write_text(f"engine: {{model: {tiny_model_dir}}}\n"
                      "train: {lr: 0.003, seed: 1, checkpoint_every: 0, log_to: [], lr_schedule: linear}\n"
                      "sft: {min_reward: 0.5, epochs: 4, batch_rows: 1}\n")  # fmt: skip
    out = tmp_path / "sft-budget"
    sft = ["sft", "--config", str(config), "--from", str(teacher_run), f"run_dir={out}"]
    assert main([*sft, "train.time_budget_s=0.001"]) == 0
    captured = capsys.readouterr()
    first = json.loads((out / "sft.json").read_text())
    assert (first["steps"], first["steps_planned"], first["stopped_early"]) == (1, 4, True)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-1"]
    stopped = (
        "stopped early: train.time_budget_s (0.001 s) ran out after step 1 of 4; checkpoint step-1 saved"
    )
    assert stopped in captured.out
    assert "sft step    1/4  loss" in captured.err and "saved step-1" in captured.err  # progress per step
    assert main([*sft, "train.time_budget_s=0.001"]) == 2 and "--resume" in capsys.readouterr().err
    assert main([*sft, "sft.epochs=5", "--resume"]) == 2  # another run: refused, naming the change
    assert "sft.epochs: 4 -> 5" in capsys.readouterr().err
    assert main([*sft, "train.time_budget_s=null", "--resume"]) == 0
    assert "resumed from step 1" in capsys.readouterr().out
    resumed = json.loads((out / "sft.json").read_text())
    assert (resumed["steps"], resumed["resumed_from_step"], resumed["stopped_early"]) == (4, 1, False)
    assert resumed["target_logprob_before"] == first["target_logprob_before"]  # the base model's
    straight = tmp_path / "sft-straight"
    assert main([*sft[:-1], f"run_dir={straight}"]) == 0
    records = [
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (out, straight)
    ]
    assert [r["step"] for r in records[0]] == [1, 2, 3, 4]  # each step logged once
    for key in ("loss", "lr"):  # the optimizer's moments and the LR schedule went on where they stopped
        assert [r[key] for r in records[0]] == pytest.approx([r[key] for r in records[1]])
    a, b = weights(out / "checkpoints" / "step-4"), weights(straight / "checkpoints" / "step-4")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    store = SQLiteStore(teacher_run / "store.sqlite")  # the source regraded: the 0-reward rollout passes now
    (zero,) = [r for r in store.list_rollouts()[0] if (g := store.get_reward(r.rollout_id)) and g.value == 0]
    store.set_reward(zero.rollout_id, RewardIn(value=1.0))
    store.close()
    assert main([*sft, "--resume"]) == 2  # other rows than the checkpoint's: refused, not mixed
    assert "the rows of sft.source are not those it trained on" in capsys.readouterr().err
