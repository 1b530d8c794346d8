"""Supervised fine-tuning on recorded calls: `harnessrl sft --config C --from RUN_DIR|TRACE`.

Per row of the SFT data (`trainer.sft_data`: one row per merged sequence, loss mask 1 on the answers'
tokens only) and trainable token t with loss weight w_t (`train.loss_mode`, over the optimizer step's
rows, as in RL):

    ℓ_t = −log π_θ(x_t | x_<t)          (temperature 1)
    L   = Σ_t w_t · ℓ_t

Rows are shuffled per epoch (seed `train.seed`) and taken `sft.batch_rows` at a time, one AdamW step each
(gradient clipped to `train.max_grad_norm`; the learning rate `sft.lr`, else `train.lr`, times RL's
schedule `train.lr_schedule` with `train.warmup_steps` and `train.min_lr_ratio` over the SFT run's own
steps, not `train.steps`); each step's rows are cut into micro-batches by
`train.micro_batch_tokens`, rows sharing a prefix together (`trainer.ppo.micro_batches`).

The model and optimizer are the RL trainer's (`runs.context.build_trainer`): the model in `train.dtype`
on `train.device`, its linear layers routed by `train.matmul`, and `trainer.precision.make_optimizer`'s
AdamW (`MasterAdamW` with exact fp32 master weights under bfloat16, its first moment in
`train.exp_avg_dtype`). Settings it cannot honour are refused before anything is read
(`config.teaching.sft_unsupported`: `train.world_size` > 1, `train.lora`, `train.moe_aux_loss_coef`).

The run settings are RL's (`trainer.loop`): a checkpoint every `train.checkpoint_every` steps and after
the last step (SFT's product, so also with 0), pruned to the newest `train.keep_checkpoints`; training
stops after the step during which `train.time_budget_s` ran out, with a checkpoint of that step and
`stopped_early` in sft.json; each step's metrics go to metrics.jsonl and the trackers of `train.log_to`.
A checkpoint is what RL saves (`<run_dir>/checkpoints/step-N`, an HF folder in the model's dtype, the
optimizer's state and LR schedule beside it): `harnessrl eval --model` and `harnessrl export-model` read
it, RL continues from it with `engine.model=<that folder>`, and `--resume` continues this SFT run from
its newest one (the same config, and the same rows: their digest is in the checkpoint).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from harnessrl.adapter import LossMode, Row, apply_length_limit, loss_weights
from harnessrl.config import RunConfig
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.trainer.budget import TimeBudget, stop_line
from harnessrl.trainer.checkpoint import (
    checkpoint_due,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from harnessrl.trainer.forward import selected_logprobs, shareable_prefix
from harnessrl.trainer.metrics import MetricsLogger
from harnessrl.trainer.ppo import first_trainable, lr_lambda, micro_batches, release_memory

if TYPE_CHECKING:
    from harnessrl.trainer.sft_data import SftReport

log = logging.getLogger(__name__)

OnStep = Callable[[int, int, dict[str, Any]], None]  # (step, steps planned, its metrics) after each step


def _pack(rows: list[Row], weights: list[list[float]], device: torch.device) -> tuple[Tensor, Tensor, int]:
    """Right-padded tokens [B, L], the shifted loss weights [B, L-1] and the shared prefix length."""
    length = max(len(r.tokens) for r in rows)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    w = torch.zeros(len(rows), length)
    for j, (r, rw) in enumerate(zip(rows, weights, strict=True)):
        tokens[j, : len(r.tokens)] = torch.tensor(r.tokens)
        w[j, : len(r.tokens)] = torch.tensor(rw) * torch.tensor(r.loss_mask, dtype=torch.float32)
    prefix = shareable_prefix([r.tokens for r in rows], [first_trainable(r.loss_mask) for r in rows])
    return tokens.to(device), w[:, 1:].to(device), prefix


def target_logprobs(
    model: CausalLM, rows: list[Row], weights: list[list[float]], pack_rows: str = "auto"
) -> tuple[Tensor, Tensor]:
    """log π(x_t | x_<t) at temperature 1 of every token with loss mask 1 of `rows`, and their weights
    (`pack_rows`: `train.pack_rows`)."""
    tokens, w, prefix = _pack(rows, weights, next(model.parameters()).device)
    select = w > 0
    temps = torch.ones(len(rows), device=tokens.device)
    sel = selected_logprobs(model, tokens, select, temps, prefix, pack=pack_rows)
    return sel.logprobs, w[sel.row, sel.pos]


def _groups(rows: list[Row], budget: int) -> list[list[int]]:
    return micro_batches([r.tokens for r in rows], [first_trainable(r.loss_mask) for r in rows], budget)


def sft_step(
    model: CausalLM, optimizer: torch.optim.Optimizer, rows: list[Row], mode: LossMode, budget: int,
    max_grad_norm: float, pack_rows: str = "auto",
) -> dict[str, float]:  # fmt: skip
    """One optimizer step of L = Σ w_t ℓ_t over `rows`; returns loss, gradient norm, tokens and the mean
    target logprob before the step."""
    weights = loss_weights(rows, mode)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, lp_sum, n = 0.0, 0.0, 0
    for idx in _groups(rows, budget):
        lp, w = target_logprobs(model, [rows[i] for i in idx], [weights[i] for i in idx], pack_rows)
        loss = -(lp * w).sum()
        loss.backward()
        total += float(loss.detach())
        lp_sum += float(lp.detach().sum())
        n += lp.numel()
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trained, max_grad_norm))
    if torch.isfinite(torch.tensor(grad_norm)):
        optimizer.step()
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total, "grad_norm": grad_norm, "trainable_tokens": float(n),
            "target_logprob": lp_sum / max(n, 1)}  # fmt: skip


@torch.no_grad()
def mean_target_logprob(model: CausalLM, rows: list[Row], budget: int, pack_rows: str = "auto") -> float:
    """Mean log π of the trainable tokens of `rows` (every token counted once)."""
    total, n = 0.0, 0
    for idx in _groups(rows, budget):
        sub = [rows[i] for i in idx]
        lp, _ = target_logprobs(model, sub, [[1.0] * len(r.tokens) for r in sub], pack_rows)
        total += float(lp.sum())
        n += lp.numel()
    return total / max(n, 1)


def step_batches(n_rows: int, batch_rows: int, epochs: int, seed: int) -> list[list[int]]:
    """The row indices of every optimizer step: each epoch a fresh shuffle cut into `batch_rows`."""
    out: list[list[int]] = []
    for epoch in range(epochs):
        order = list(range(n_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out += [order[i : i + batch_rows] for i in range(0, n_rows, batch_rows)]
    return out


def build_model_and_optimizer(cfg: RunConfig, model_dir: Path) -> tuple[CausalLM, torch.optim.Optimizer, str]:
    """The model of `model_dir` and its AdamW as the RL trainer builds them (`runs.context.build_trainer`,
    one process, full fine-tuning): in `train.dtype` on `train.device`, linear layers routed by
    `train.matmul`; `make_optimizer` (bf16: `MasterAdamW`, first moment in `train.exp_avg_dtype`) at
    `sft.lr` (else `train.lr`). Also returns the matmul path chosen (for the log and sft.json)."""
    from harnessrl.modeling.hf_generic import is_generic
    from harnessrl.modeling.loading import load_model
    from harnessrl.modeling.packed import use_onednn_for_training
    from harnessrl.trainer.precision import make_optimizer, torch_dtype

    t = cfg.train
    model = load_model(model_dir, dtype=torch_dtype(t.dtype), device=t.device)
    matmul = (
        "aten (transformers path)"
        if is_generic(model)
        else use_onednn_for_training(model, t.matmul, model.lm_head.weight.device)
    )
    log.info("event=trainer_matmul path=%r dtype=%s", matmul, t.dtype)
    dtype = next(model.parameters()).dtype
    optimizer = make_optimizer(
        model.parameters(),
        dtype,
        cfg.sft.lr or t.lr,
        t.weight_decay,
        t.exp_avg_dtype,
        t.bf16_rounding,
        t.seed,
    )
    return model, optimizer, matmul


def rows_digest(rows: list[Row]) -> str:
    """A fingerprint of the rows' tokens and loss masks, kept in each checkpoint: a resumed run must train
    on the rows it started on (the steps' row indices come from their order)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.tokens, r.loss_mask]).encode())
    return h.hexdigest()[:16]


def restore_sft(run_dir: Path, model: CausalLM, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, digest: str) -> dict[str, Any] | None:  # fmt: skip
    """Load the newest checkpoint of `run_dir` into the model, optimizer and schedule (`--resume`) and
    return its state (with `step`); None when there is none yet. Refuses one that is not this SFT run's."""
    from harnessrl.trainer.sft_data import SftDataError

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return None
    saved = json.loads((ckpt / "state.json").read_text())
    if not saved.get("sft") or "rows_digest" not in saved:
        raise SftDataError(f"cannot resume from {ckpt}: it is not a checkpoint of a resumable SFT run "
                           "(an RL run's, or an SFT run's from before resume); start again with --fresh")  # fmt: skip
    if saved["rows_digest"] != digest:
        raise SftDataError(f"cannot resume from {ckpt}: the rows of sft.source are not those it trained on "
                           f"({saved.get('rows')} rows then, digest {saved['rows_digest']}; now {digest}): the "
                           "source changed since; start again with --fresh")  # fmt: skip
    state = load_checkpoint(ckpt, model, optimizer, scheduler)
    log.info("event=sft_resumed step=%d checkpoint=%s", state["step"], ckpt)
    return state


def train_steps(cfg: RunConfig, model: CausalLM, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, rows: list[Row], steps: list[list[int]],
                start: int, metrics: MetricsLogger, save: Callable[[int], Path],
                on_step: OnStep | None = None) -> tuple[int, bool]:  # fmt: skip
    """Steps `start + 1` .. `len(steps)`, saved every `train.checkpoint_every` and after the last, until
    `train.time_budget_s` of them ran out; returns (steps done in total, stopped by the time budget)."""
    t = cfg.train
    budget = TimeBudget(t.time_budget_s)
    for n in range(start + 1, len(steps) + 1):
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        m: dict[str, Any] = sft_step(model, optimizer, [rows[i] for i in steps[n - 1]], t.loss_mode,
                                     t.micro_batch_tokens, t.max_grad_norm, t.pack_rows)  # fmt: skip
        scheduler.step()
        m.update(lr=lr, time_step_s=time.perf_counter() - t0)
        metrics.log(n, m)
        log.info("event=sft_step step=%d loss=%.4f target_logprob=%.4f", n, m["loss"], m["target_logprob"])
        stopping = budget.stops(n, len(steps))
        # the last step is SFT's product: saved also with checkpoint_every 0, and so is a budget stop's
        if n == len(steps) or stopping or checkpoint_due(n, len(steps), t.checkpoint_every):
            m["checkpoint"] = str(save(n))
        if on_step is not None:
            on_step(n, len(steps), m)
        if stopping:
            log.info("event=sft_time_budget step=%d of=%d budget_s=%g", n, len(steps), t.time_budget_s)
            return n, True
    return len(steps), False


def run_sft(cfg: RunConfig, source: Path | None = None, fresh: bool = False, resume: bool = False,
            on_step: OnStep | None = None) -> dict[str, Any]:  # fmt: skip
    """Fine-tune `engine.model` on the rows of `source` (default: `sft.source`; module docstring);
    writes checkpoints, metrics.jsonl (and `train.log_to`'s trackers) and sft.json to `run_dir` and
    returns the summary. `resume` continues the run in `run_dir` from its newest checkpoint. What
    `harnessrl sft` and `harnessrl train` with `train.algorithm: sft` run."""
    from harnessrl.runs.rundir import Mode, prepare, run_id
    from harnessrl.trainer.trackers import make_trackers

    t0 = time.time()
    source, rows, report, model_dir = _rows(cfg, source)
    run_dir = Path(cfg.run_dir).resolve()
    prepare(run_dir, cfg, Mode.RESUME if resume else Mode.FRESH if fresh else Mode.NEW)
    s, t = cfg.sft, cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)  # as the RL run does (runs/flow.py)
    torch.manual_seed(t.seed)
    model, optimizer, matmul = build_model_and_optimizer(cfg, model_dir)
    steps = step_batches(len(rows), s.batch_rows, s.epochs, t.seed)
    # RL's LR schedule (train.lr_schedule, warmup_steps, min_lr_ratio) over SFT's own steps
    schedule = lr_lambda(t.lr_schedule, t.warmup_steps, len(steps), t.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    digest = rows_digest(rows)
    saved = restore_sft(run_dir, model, optimizer, scheduler, digest) if resume else None
    start = int(saved["step"]) if saved else 0
    before = saved["target_logprob_before"] if saved else mean_target_logprob(
        model, rows, t.micro_batch_tokens, t.pack_rows)  # fmt: skip
    state = {"sft": True, "source": str(source), "rows": len(rows), "rows_digest": digest,
             "target_logprob_before": before}  # fmt: skip

    def save(step: int) -> Path:
        path = save_checkpoint(run_dir / "checkpoints", step, model, optimizer, state, scheduler)
        prune_checkpoints(run_dir / "checkpoints", t.keep_checkpoints)
        return path

    metrics = MetricsLogger(run_dir, make_trackers(
        t.log_to, run_dir, run_id(run_dir), cfg.name, cfg.model_dump(mode="json"), t.wandb_project,
        t.wandb_mode, t.mlflow_tracking_uri))  # fmt: skip
    metrics.truncate_after(start)  # steps after the checkpoint are done again: logged once
    try:
        done, stopped = train_steps(
            cfg, model, optimizer, scheduler, rows, steps, start, metrics, save, on_step
        )
    finally:
        metrics.close()
    release_memory(model, optimizer)
    after = mean_target_logprob(model, rows, t.micro_batch_tokens, t.pack_rows)
    summary = {"source": str(source), "report": report.as_dict(), "rows": len(rows), "steps": done,
               "steps_planned": len(steps), "stopped_early": stopped, "time_budget_s": t.time_budget_s,
               "resumed_from_step": start if saved else None,
               "target_logprob_before": before, "target_logprob_after": after,
               "checkpoint": str(run_dir / "checkpoints" / f"step-{done}"),
               "dtype": t.dtype, "exp_avg_dtype": t.exp_avg_dtype, "bf16_rounding": t.bf16_rounding,
               "optimizer": type(optimizer).__name__, "matmul": matmul, "wall_seconds": time.time() - t0}  # fmt: skip
    (run_dir / "sft.json").write_text(json.dumps(summary, indent=2))
    return summary


def _rows(cfg: RunConfig, source: Path | None) -> tuple[Path, list[Row], SftReport, Path]:
    """The source, its SFT rows (filtered, cut to `train.max_row_tokens`), the filter's report and the
    student's model folder; refuses what SFT cannot honour before anything is read."""
    from harnessrl.config.teaching import sft_unsupported
    from harnessrl.errors import ConfigError
    from harnessrl.gateway.engine_client.inference import TitoTokenizer
    from harnessrl.modeling.loading import resolve_model
    from harnessrl.trainer.sft_data import SftDataError, load_details, sft_rows

    problem = sft_unsupported(cfg.train)
    if problem:
        raise ConfigError(problem)
    if source is None:
        if not cfg.sft.source:
            raise SftDataError("no calls to train on: set sft.source (or harnessrl sft --from RUN_DIR|TRACE)")
        source = Path(cfg.sft.source)
    run_dir = Path(cfg.run_dir).resolve()
    if run_dir == source.resolve():
        raise SftDataError(
            f"run_dir {run_dir} is the source of the traces; choose another (run_dir=runs/NAME)"
        )
    details = load_details(source)
    model_dir = resolve_model(cfg.engine.model)
    tok = TitoTokenizer.from_dir(str(model_dir), tool_parser=cfg.engine.tool_parser,
                                 template_kwargs=cfg.engine.chat_template_kwargs)  # fmt: skip
    s, t = cfg.sft, cfg.train
    rows, report = sft_rows(details, tok, s.min_reward, s.retemplate, s.include_eval)
    rows, _ = apply_length_limit(rows, t.max_row_tokens)
    rows = [r for r in rows if r.n_trainable]
    if not rows:
        raise SftDataError(f"no rows to train on from {source}: {report.as_dict()} (lower sft.min_reward?)")
    return source, rows, report, model_dir


def render(s: dict[str, Any]) -> str:
    """The report of an SFT run: what the filter kept, the steps, the target logprob, the checkpoint."""
    r = s["report"]
    steps = (
        f"{s['steps']} steps"
        if s["steps"] == s["steps_planned"]
        else f"{s['steps']} of {s['steps_planned']} steps"
    )
    resumed = f", resumed from step {s['resumed_from_step']}" if s["resumed_from_step"] is not None else ""
    lines = [
        f"{r['kept']} of {r['rollouts']} rollouts kept ({r['retemplated']} re-rendered with the student's "
        f"template, text-level); {s['rows']} rows, {r['trainable_tokens']} trainable tokens",
        f"{steps} in {s['dtype']} ({s['optimizer']}, matmul {s['matmul']}{resumed}): mean target logprob "
        f"{s['target_logprob_before']:.4f} -> {s['target_logprob_after']:.4f}",
    ]
    if s["stopped_early"]:
        name = Path(s["checkpoint"]).name
        resume = "the same command with --resume"
        lines.append(
            "stopped early: " + stop_line(s["time_budget_s"], s["steps"], s["steps_planned"], name, resume)
        )
    lines.append(f"checkpoint: {s['checkpoint']}  (RL from it: engine.model={s['checkpoint']})")
    return "\n".join(lines)


def print_step(step: int, total: int, m: dict[str, Any]) -> None:
    """The CLI's progress line of one SFT step (stderr)."""
    saved = f"  saved {Path(m['checkpoint']).name}" if "checkpoint" in m else ""
    print(f"sft step {step:4d}/{total}  loss {m['loss']:.4f}  target logprob {m['target_logprob']:+.4f}  "
          f"lr {m['lr']:.2e}  tokens {int(m['trainable_tokens'])}  {m['time_step_s']:.1f}s{saved}",
          file=sys.stderr, flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    """`harnessrl sft --config C [--from RUN_DIR|TRACE] [--fresh|--resume] [overrides]` (`--from` sets
    `sft.source`)."""
    from harnessrl.config import ConfigError, load_config
    from harnessrl.runs.rundir import RunDirError
    from harnessrl.trainer.sft_data import SftDataError
    from harnessrl.trainer.trackers import TrackerError

    p = argparse.ArgumentParser(
        prog="harnessrl sft", description="fine-tune the config's model on recorded calls"
    )
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--from", dest="source", type=Path,
                   help="a run directory or a trace file (harnessrl export --format trace); default: sft.source")  # fmt: skip
    how = p.add_mutually_exclusive_group()
    how.add_argument("--fresh", action="store_true", help="delete an earlier run in run_dir first")
    how.add_argument("--resume", action="store_true",
                     help="continue the SFT run in run_dir from its newest checkpoint (same config and rows)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.min_reward=1 run_dir=runs/sft")
    args = p.parse_args(argv)
    source = [f"sft.source={json.dumps(str(args.source))}"] if args.source else []
    try:
        cfg = load_config(args.config, [*args.overrides, *source])
        s = run_sft(cfg, fresh=args.fresh, resume=args.resume, on_step=print_step)
    except (ConfigError, SftDataError, RunDirError, TrackerError) as e:
        print(f"harnessrl sft: {e}", file=sys.stderr)
        return 2
    print(render(s))
    return 0
