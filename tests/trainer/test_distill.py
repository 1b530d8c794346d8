"""On-policy distillation: two tiny models of one tokenizer (SmolLM2's), the teacher scoring the student's
tokens in-process and through a real HTTP server in vLLM's `prompt_logprobs` wire; the advantage against
its formula; a few PPO updates on it bring the student's reverse KL to the teacher down; a teacher of
another vocabulary is refused naming both; a failing teacher fails the step."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.adapter import Batch, LossMode, Row, loss_weights
from harnessrl.config import RunConfig
from harnessrl.config.teaching import TeacherSection
from harnessrl.modeling.loading import load_model, make_tiny_model_dir
from harnessrl.modeling.logprobs import next_token_logprobs
from harnessrl.trainer.ppo import PPOConfig, ppo_update
from harnessrl.trainer.teacher import (
    HttpTeacher,
    LocalTeacher,
    TeacherError,
    TeacherMismatch,
    check_teacher,
    distill_advantages,
    distill_batch,
)
from tests.support.families import TOKENIZERS
from tests.support.gateway import ThreadServer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (other weights) with the student's tokenizer."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("teacher"), seed=7)


def rows_of(seed: int, n: int = 3) -> list[Row]:
    """Rows of prompt, sampled answer, observation, sampled answer; old logprobs filled in later."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        parts = [[rnd.randint(3, 49000) for _ in range(rnd.randint(2, 6))] for _ in range(4)]
        mask = [0] * len(parts[0]) + [1] * len(parts[1]) + [0] * len(parts[2]) + [1] * len(parts[3])
        rows.append(Row(f"r{i}", [t for p in parts for t in p], mask, [0.0] * len(mask), 1.0))
    return rows


def full_forward(model: torch.nn.Module, row: Row) -> list[float]:
    """log π of each token of the row given the ones before it (0.0 at the first), one row at a time."""
    with torch.no_grad():
        ids = torch.tensor([row.tokens])
        return [0.0, *next_token_logprobs(model(ids), ids, 1.0)[0].tolist()]


def test_teacher_scores_are_its_logprobs_of_the_students_tokens(teacher_dir: Path) -> None:
    teacher = LocalTeacher(load_model(teacher_dir), "t", batch_rows=2)
    rows = rows_of(1)
    scored = asyncio.run(teacher.score(rows))
    for row, tau in zip(rows, scored, strict=True):
        want = [
            lp if m else 0.0 for lp, m in zip(full_forward(teacher.model, row), row.loss_mask, strict=True)
        ]
        assert tau == pytest.approx(want, abs=1e-4)


def test_distillation_advantage_and_updates_move_the_student_to_the_teacher(
    tiny_model_dir: Path, teacher_dir: Path
) -> None:
    """With A_t = τ_t − μ_t the PPO gradient at ratio 1 is Σ (μ_t − τ_t) ∇μ_t = ∇ ½ Σ (μ_t − τ_t)²: on
    fixed tokens the updates close the per-token gap to the teacher (on the student's own samples its
    expectation is the gradient of the reverse KL)."""
    torch.manual_seed(0)
    student, teacher = load_model(tiny_model_dir), LocalTeacher(load_model(teacher_dir), "t")
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    rows = rows_of(2, n=2)
    gaps = []
    for step in range(3):
        for row in rows:  # the behaviour logprobs, as the engine records them for the student's samples
            row.old_logprobs = [
                lp * m for lp, m in zip(full_forward(student, row), row.loss_mask, strict=True)
            ]
        batch = Batch(rows, [0.5, -0.5], loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})
        metrics = asyncio.run(distill_batch(teacher, batch, coef=1.0, rl=False))
        assert batch.token_advantages is not None and metrics["teacher_tokens"] == sum(
            r.n_trainable for r in rows
        )
        gap = [a for adv in batch.token_advantages for a in adv]  # τ − μ on trainable tokens, 0 elsewhere
        gaps.append(sum(a * a for a in gap) / metrics["teacher_tokens"])
        if step == 0:
            tau = asyncio.run(teacher.score(rows))
            for row, adv, t in zip(rows, batch.token_advantages, tau, strict=True):
                want = [(a - b) * m for a, b, m in zip(t, row.old_logprobs, row.loss_mask, strict=True)]
                assert adv == pytest.approx(want)
            assert metrics["distill_reverse_kl"] == pytest.approx(-sum(gap) / metrics["teacher_tokens"])
            with_rl = distill_advantages(Batch(rows, [0.5, -0.5], batch.weights, {}), tau, 0.5, rl=True)
            i = rows[0].loss_mask.index(1)
            assert with_rl[0][i] == pytest.approx(0.5 * (tau[0][i] - rows[0].old_logprobs[i]) + 0.5)
            assert with_rl[0][0] == 0.0  # a prompt token: no advantage
        ppo_update(student, optimizer, batch, PPOConfig(clip_low=10.0, clip_high=10.0))
    assert gaps[-1] < 0.7 * gaps[0], gaps


def vllm_scorer(model: torch.nn.Module, fail: bool = False) -> Starlette:
    """`/v1/completions` with `prompt_logprobs` in vLLM's shape, computed by a real model."""

    async def completions(request: Request) -> Response:
        body = await request.json()
        if fail:
            return JSONResponse({"error": "out of memory"}, status_code=500)
        assert body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
        choices = []
        for i, ids in enumerate(body["prompt"]):
            row = Row("x", ids, [1] * len(ids), [0.0] * len(ids), 1.0)
            lps = full_forward(model, row)
            entries = [None] + [
                {str(t): {"logprob": lp, "rank": 1, "decoded_token": "?"}}
                for t, lp in zip(ids[1:], lps[1:], strict=True)
            ]
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "token_ids": [0],
                    "prompt_logprobs": entries,
                    "finish_reason": "length",
                }
            )
        return JSONResponse(
            {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices[::-1]}
        )

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_http_teacher_batches_requests_and_a_failure_fails_the_step(teacher_dir: Path) -> None:
    model = load_model(teacher_dir)
    rows = rows_of(3, n=5)
    local = asyncio.run(LocalTeacher(model, "t").score(rows))

    async def score(url: str) -> list[list[float]]:
        teacher = HttpTeacher(TeacherSection(url=url, model="teacher", batch_rows=2))
        try:
            return await teacher.score(rows)
        finally:
            await teacher.aclose()

    with ThreadServer(vllm_scorer(model)) as srv:
        remote = asyncio.run(score(srv.url))
    for a, b in zip(remote, local, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    with (
        ThreadServer(vllm_scorer(model, fail=True)) as srv,
        pytest.raises(TeacherError, match="answered 500"),
    ):
        asyncio.run(score(srv.url))


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    if not (TOKENIZERS / "qwen3" / "tokenizer.json").is_file():
        pytest.skip("Qwen3's tokenizer is not in .cache/tokenizers (make install)")
    qwen = tmp_path / "qwen3-teacher"
    qwen.mkdir()
    shutil.copyfile(TOKENIZERS / "qwen3" / "tokenizer.json", qwen / "tokenizer.json")
    with pytest.raises(TeacherMismatch) as e:
        check_teacher(tiny_model_dir, qwen)
    assert (
        str(qwen) in str(e.value) and str(tiny_model_dir) in str(e.value) and "harnessrl sft" in str(e.value)
    )
    check_teacher(tiny_model_dir, tiny_model_dir)  # the same tokenizer passes
    cfg = RunConfig.model_validate({"train": {"teacher": {"model": str(qwen)}, "distill_coef": 0.5}})
    assert cfg.train.teacher is not None and not cfg.train.teacher.rl
    with pytest.raises(ValueError, match=r"model \(a model folder\) or url"):
        RunConfig.model_validate({"train": {"teacher": {}}})
    with pytest.raises(ValueError, match="sync schedule"):
        RunConfig.model_validate({"train": {"teacher": {"model": "x"}, "schedule": "async"}})
