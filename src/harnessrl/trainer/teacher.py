"""On-policy distillation: a teacher scores every token the student sampled (`train.teacher`).

For a trainable token t of a row (sampled by the student at logprob μ_t, recorded by the gateway) and the
teacher's logprob τ_t of that same token ID in the same context, the per-token reverse KL estimate and
the advantage that trains on it are

    k_t = μ_t − τ_t                      (one-sample estimate of KL(π_student ‖ π_teacher) at t)
    A_t = c · (τ_t − μ_t) [+ A_rollout]  (c = `train.distill_coef`; + the RL advantage with `teacher.rl`)

and A_t enters the PPO loss as the per-token advantage (`Batch.token_advantages`, the same path as step
credit). Tokens the teacher finds likelier than the student did are pushed up, the others down, so the
student's reverse KL to the teacher falls: the teacher's signal, on the student's own states.

The teacher scores token IDs, so it must share the student's tokenizer: `check_teacher` refuses another
vocabulary before the run starts, naming both. Two teachers:
- `LocalTeacher` (`teacher.model`: a model folder): loaded beside the trainer, frozen, scored in
  micro-batches of `teacher.batch_rows` rows with the trainer's own forward (`trainer.forward`);
- `HttpTeacher` (`teacher.url`): any server answering `/v1/completions` for token-ID prompts with vLLM's
  `prompt_logprobs` (`choices[i].prompt_logprobs[t][str(id)].logprob`), `teacher.batch_rows` prompts per
  request. A failed request is the step's error (`TeacherError`), never a zero.
Both score at temperature 1 (the teacher's distribution itself).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from harnessrl.adapter import Batch, Row
from harnessrl.config import RunConfig
from harnessrl.config.teaching import TeacherSection
from harnessrl.errors import ConfigError
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.trainer.forward import selected_logprobs, shareable_prefix
from harnessrl.trainer.ppo import first_trainable

log = logging.getLogger(__name__)


class TeacherError(RuntimeError):
    """The teacher could not score a step's tokens (the step fails; nothing is trained on a zero)."""


class TeacherMismatch(ConfigError):
    """The teacher's tokenizer is not the student's: its logprobs would be of other tokens."""


class Teacher(Protocol):
    """What distillation needs of a teacher: logprobs of given token IDs."""

    name: str

    async def score(self, rows: list[Row]) -> list[list[float]]:
        """τ at every position of every row (0.0 where the loss mask is 0)."""
        ...

    async def aclose(self) -> None:
        """Release the teacher's resources."""
        ...


def _vocab(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)


def check_teacher(student: Path, teacher: Path, what: str = "train.teacher") -> None:
    """Refuse a teacher whose tokenizer (vocabulary and added tokens) is not the student's."""
    s, t = _vocab(student), _vocab(teacher)
    if s == t:
        return
    differ = sorted(set(s.items()) ^ set(t.items()))[:1]
    raise TeacherMismatch(
        f"{what}: the teacher's tokenizer ({teacher}, {len(t):,} tokens) is not the student's ({student}, "
        f"{len(s):,} tokens; first difference {differ[0] if differ else '?'}): on-policy distillation "
        "scores the student's token IDs, so both must share one vocabulary. Use a teacher of the student's "
        "family, or fine-tune on the teacher's traces instead (harnessrl sft re-renders them text-level)."
    )


def _place(rows: list[Row], scored: list[list[float]]) -> list[list[float]]:
    """Each row's trainable-token scores at their positions (0.0 elsewhere)."""
    out = []
    for row, lps in zip(rows, scored, strict=True):
        it = iter(lps)
        out.append([next(it) if m else 0.0 for m in row.loss_mask])
    return out


class LocalTeacher:
    """A frozen model folder scored in this process (`teacher.model`)."""

    def __init__(self, model: CausalLM, name: str, batch_rows: int = 8) -> None:
        """`model`: the teacher, loaded; `batch_rows`: rows per forward."""
        self.model, self.name, self.batch_rows = model, name, batch_rows
        self.model.eval()

    @torch.no_grad()
    def score_sync(self, rows: list[Row]) -> list[list[float]]:
        """`score`, in the calling thread."""
        out: list[list[float]] = []
        device = next(self.model.parameters()).device
        for start in range(0, len(rows), self.batch_rows):
            chunk = rows[start : start + self.batch_rows]
            length = max(len(r.tokens) for r in chunk)
            tokens = torch.zeros(len(chunk), length, dtype=torch.long)
            select = torch.zeros(len(chunk), length, dtype=torch.bool)
            for j, r in enumerate(chunk):
                tokens[j, : len(r.tokens)] = torch.tensor(r.tokens)
                select[j, : len(r.tokens)] = torch.tensor(r.loss_mask, dtype=torch.bool)
            prefix = shareable_prefix(
                [r.tokens for r in chunk], [first_trainable(r.loss_mask) for r in chunk]
            )
            temps = torch.ones(len(chunk), device=device)
            sel = selected_logprobs(self.model, tokens.to(device), select[:, 1:].to(device), temps, prefix)
            lps = sel.logprobs.float().cpu()
            rows_of = sel.row.cpu()
            out += [lps[rows_of == j].tolist() for j in range(len(chunk))]
        return _place(rows, out)

    async def score(self, rows: list[Row]) -> list[list[float]]:
        """τ of every trainable token of `rows` (see the module docstring)."""
        return await asyncio.to_thread(self.score_sync, rows)

    async def aclose(self) -> None:
        """Nothing to release beyond the model (garbage collected with the teacher)."""


class HttpTeacher:
    """A server scoring token-ID prompts with vLLM's `prompt_logprobs` (`teacher.url`)."""

    def __init__(self, cfg: TeacherSection) -> None:
        """The client of `cfg.url` with `cfg.api_key`."""
        assert cfg.url is not None
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.cfg, self.name = cfg, cfg.model or cfg.url
        self.client = httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, timeout=cfg.timeout_s)

    async def _request(self, rows: list[Row]) -> list[list[float]]:
        body = {"model": self.cfg.model, "prompt": [r.tokens for r in rows], "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": 0}  # fmt: skip
        try:
            r = await self.client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise TeacherError(f"teacher {self.cfg.url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise TeacherError(f"teacher {self.cfg.url} answered {r.status_code}: {r.text[:300]}")
        try:
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            return [prompt_logprobs(row, c["prompt_logprobs"]) for row, c in zip(rows, choices, strict=True)]
        except (KeyError, TypeError, ValueError) as e:
            raise TeacherError(
                f"teacher {self.cfg.url}: no prompt_logprobs for the tokens sent ({e!r})"
            ) from e

    async def score(self, rows: list[Row]) -> list[list[float]]:
        """τ of every trainable token of `rows`, `batch_rows` prompts per request, requests concurrent."""
        n = self.cfg.batch_rows
        parts = await asyncio.gather(*(self._request(rows[i : i + n]) for i in range(0, len(rows), n)))
        return [lp for part in parts for lp in part]

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self.client.aclose()


def prompt_logprobs(row: Row, entries: list[dict[str, Any] | None]) -> list[float]:
    """A row's τ from vLLM's `prompt_logprobs` (entry t: {str(token id): {"logprob": ...}}; entry 0 None)."""
    if len(entries) != len(row.tokens):
        raise ValueError(f"{len(entries)} prompt_logprobs for {len(row.tokens)} tokens")
    out = []
    for t, (tok, m) in enumerate(zip(row.tokens, row.loss_mask, strict=True)):
        if not m:
            out.append(0.0)
            continue
        entry = entries[t]
        if entry is None or str(tok) not in entry:
            raise ValueError(f"position {t}: no logprob of token {tok}")
        out.append(float(entry[str(tok)]["logprob"]))
    return out


def refuse_other_tokenizer(cfg: RunConfig) -> None:
    """Before a run: a `train.teacher` folder (or a URL teacher's `tokenizer`) must have the student's
    tokenizer (`check_teacher`)."""
    from harnessrl.modeling.loading import resolve_model

    teacher = cfg.train.teacher
    if teacher is None:
        return
    folder = teacher.tokenizer if teacher.url is not None else teacher.model
    if folder:
        check_teacher(resolve_model(cfg.engine.model), resolve_model(folder))


def make_teacher(cfg: TeacherSection, student_dir: Path, device: str = "cpu") -> Teacher:
    """The run's teacher, after `check_teacher` (a folder: its tokenizer; a URL: `cfg.tokenizer`'s)."""
    from harnessrl.modeling.loading import load_model, resolve_model

    if cfg.url is not None:
        if cfg.tokenizer:
            check_teacher(student_dir, Path(cfg.tokenizer))
        return HttpTeacher(cfg)
    folder = resolve_model(cfg.model)
    check_teacher(student_dir, folder)
    return LocalTeacher(load_model(folder, device=device), str(folder), cfg.batch_rows)


def distill_advantages(
    batch: Batch, teacher_lps: list[list[float]], coef: float, rl: bool
) -> list[list[float]]:
    """A_t = coef · (τ_t − μ_t) on trainable tokens, plus the RL advantage (per token or the row's) if `rl`."""
    out = []
    for i, (row, tau) in enumerate(zip(batch.rows, teacher_lps, strict=True)):
        base = (
            batch.token_advantages[i]
            if batch.token_advantages is not None
            else [batch.advantages[i]] * len(row.tokens)
        )
        out.append([
            (coef * (t - mu) + (b if rl else 0.0)) if m else 0.0
            for t, mu, m, b in zip(tau, row.old_logprobs, row.loss_mask, base, strict=True)
        ])  # fmt: skip
    return out


async def distill_batch(
    teacher: Teacher, batch: Batch, coef: float, rl: bool, record: Path | None = None, step: int = 0
) -> dict[str, Any]:
    """Score the batch's rows with the teacher and set their per-token advantages; returns the step's
    distillation metrics (teacher time, tokens, mean reverse KL, mean student and teacher logprobs).
    `record`: a JSONL file the teacher's logprobs of step `step` are appended to."""
    t0 = time.perf_counter()
    tau = await teacher.score(batch.rows) if batch.rows else []
    seconds = time.perf_counter() - t0
    if record is not None:
        record_teacher_logprobs(record, step, batch, tau)
    batch.token_advantages = distill_advantages(batch, tau, coef, rl)
    pairs = [(mu, t) for row, lps in zip(batch.rows, tau, strict=True)
             for mu, t, m in zip(row.old_logprobs, lps, row.loss_mask, strict=True) if m]  # fmt: skip
    n = max(len(pairs), 1)
    return {
        "time_teacher_s": seconds, "teacher_rows": len(batch.rows), "teacher_tokens": len(pairs),
        "distill_reverse_kl": sum(mu - t for mu, t in pairs) / n,
        "student_logprob": sum(mu for mu, _ in pairs) / n, "teacher_logprob": sum(t for _, t in pairs) / n,
    }  # fmt: skip


def record_teacher_logprobs(path: Path, step: int, batch: Batch, tau: list[list[float]]) -> None:
    """Append the step's teacher logprobs per row (trainable tokens only) to `path` (JSONL), for inspect."""
    with path.open("a") as f:
        for row, lps in zip(batch.rows, tau, strict=True):
            f.write(json.dumps({"step": step, "rollout_id": row.rollout_id, "call_ids": row.call_ids,
                                "teacher_logprobs": [t for t, m in zip(lps, row.loss_mask, strict=True) if m]}) + "\n")  # fmt: skip
