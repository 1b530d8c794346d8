"""The PPO-clip policy update on a batch of rows, with the engine's logprobs as the behaviour policy.

Per trainable token t of a row with advantage A (the rollout's), new logprob π_t (recomputed by the
trainer at the row's sampling temperature) and behaviour logprob μ_t (the engine's, recorded in the call):

    ρ_t = exp(π_t − μ_t)
    ℓ_t = −min(ρ_t · A, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)
    L   = Σ_t w_t · ℓ_t          (w_t: the adapter's loss weights, fixed for the whole batch)

With truncated importance sampling (`tis_cap` = C, for stale rows of the async schedule and for
engine/trainer mismatch) the clip is taken against the proximal policy π_prox — the trainer's own
logprobs under the weights at the start of the update, no gradient — and the behaviour gap becomes a
capped weight:

    ρ_t = exp(π_t − π_prox,t),   ι_t = min(exp(π_prox,t − μ_t), C)
    ℓ_t = −ι_t · min(ρ_t · A, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)

An optional KL penalty to a frozen reference policy π_ref adds β · k3_t per token, with the
non-negative estimator k3_t = exp(π_ref,t − π_t) − (π_ref,t − π_t) − 1, weighted by the same w_t.

The batch is cut into micro-batches by a token budget (rows with a common prefix together; see
`trainer.forward`); their losses are summed into the gradient, which therefore equals the whole
batch's gradient. One optimizer step per epoch over the batch; the learning-rate schedule (if any)
steps once per update.

Memory: a micro-batch's logits are computed chunk by chunk and, with `checkpoint_layers`, its layer
activations are recomputed in the backward pass (`trainer.forward`); after the update the gradients and
the heap the update freed are given back (`release_memory`), so the trainer's resident size returns
to about parameters + optimizer state between updates.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from harnessrl.adapter import Batch
from harnessrl.modeling.causal_lm import CausalLM
from harnessrl.modeling.memory import release_freed_memory, trim_heap
from harnessrl.trainer.forward import selected_logprobs, shareable_prefix
from harnessrl.trainer.moe_aux import aux_pack_rows, router_aux


@dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of the update."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    pack_rows: str = "auto"  # rows packed instead of padded: auto | on | off (trainer/packing.py)
    epochs: int = 1
    tis_cap: float | None = None  # None: clip against the engine's logprobs; C: decoupled clip + IS cap C
    kl_coef: float = 0.0  # β of the KL penalty to the reference model (needs `ref_model`)
    moe_aux_loss_coef: float = 0.0  # an MoE router's load-balancing loss (trainer/moe_aux.py; 0: off)


def ppo_token_loss(new_lp: Tensor, old_lp: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """ℓ_t = −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A) with ρ = exp(new − old), elementwise."""
    ratio = torch.exp(new_lp - old_lp)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def tis_weight(prox_lp: Tensor, behaviour_lp: Tensor, cap: float) -> Tensor:
    """ι_t = min(exp(π_prox − μ), C): the truncated importance weight of a token (no gradient)."""
    return torch.clamp(torch.exp(prox_lp - behaviour_lp), max=cap).detach()


def k3_kl(ref_lp: Tensor, new_lp: Tensor) -> Tensor:
    """k3 = exp(ref − new) − (ref − new) − 1 ≥ 0: a per-token estimate of KL(π ‖ π_ref)."""
    d = ref_lp - new_lp
    return torch.exp(d) - d - 1.0


def micro_batches(rows: list[list[int]], first_trainable: list[int], token_budget: int) -> list[list[int]]:
    """Group row indices so rows with common prefixes share a micro-batch (lexicographic order) and
    each micro-batch's cost, shared prefix + B·(longest − prefix), stays within the budget."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        candidate = [*current, i]
        prefix = shareable_prefix([rows[j] for j in candidate], [first_trainable[j] for j in candidate])
        longest = max(len(rows[j]) for j in candidate)
        if current and prefix + len(candidate) * (longest - prefix) > token_budget:
            groups.append(current)
            candidate = [i]
        current = candidate
    if current:
        groups.append(current)
    return groups


@dataclass
class _Packed:
    tokens: Tensor  # [B, L] right-padded
    select: Tensor  # [B, L-1] bool: position t predicts a trainable token t+1
    old_lp: Tensor  # [B, L-1] the engine's logprob of token t+1
    weights: Tensor  # [B, L-1] loss weight of token t+1
    adv: Tensor  # [B], or [B, L-1] (the advantage of token t+1) when the batch has token advantages
    temps: Tensor  # [B]
    prefix: int


def first_trainable(mask: list[int]) -> int:
    """Index of the first token with loss mask 1 (len(mask) if none)."""
    return next((i for i, m in enumerate(mask) if m), len(mask))


def _pack(batch: Batch, idx: list[int], device: torch.device) -> _Packed:
    rows = [batch.rows[i] for i in idx]
    length = max(len(r.tokens) for r in rows)
    tokens = torch.zeros(len(idx), length, dtype=torch.long)
    old_lp = torch.zeros(len(idx), length)
    weights = torch.zeros(len(idx), length)
    for j, i in enumerate(idx):
        n = len(batch.rows[i].tokens)
        tokens[j, :n] = torch.tensor(batch.rows[i].tokens)
        old_lp[j, :n] = torch.tensor(batch.rows[i].old_logprobs)
        weights[j, :n] = torch.tensor(batch.weights[i])
    prefix = shareable_prefix([r.tokens for r in rows], [first_trainable(r.loss_mask) for r in rows])
    return _Packed(
        tokens=tokens.to(device),
        select=(weights[:, 1:] > 0).to(device),
        old_lp=old_lp[:, 1:].to(device),
        weights=weights[:, 1:].to(device),
        adv=_advantages(batch, idx, length).to(device),
        temps=torch.tensor([r.temperature for r in rows], device=device),
        prefix=prefix,
    )


def _advantages(batch: Batch, idx: list[int], length: int) -> Tensor:
    """The rows' advantages: one per row, or per token (shifted like the weights) under step credit."""
    if batch.token_advantages is None:
        return torch.tensor([batch.advantages[i] for i in idx])
    adv = torch.zeros(len(idx), length)
    for j, i in enumerate(idx):
        adv[j, : len(batch.token_advantages[i])] = torch.tensor(batch.token_advantages[i])
    return adv[:, 1:]


def micro_batch_loss(
    model: CausalLM,
    batch: Batch,
    idx: list[int],
    cfg: PPOConfig,
    prox: Tensor | None = None,
    ref_model: CausalLM | None = None,
    checkpoint_layers: bool | None = None,
) -> tuple[Tensor, dict[str, float], Tensor]:
    """Σ w_t ℓ_t over the rows `idx` (a differentiable scalar), statistics of those tokens, and the
    new logprobs (detached: the proximal policy of later epochs). `prox` is needed when `cfg.tis_cap`
    is set and this is not the first epoch; in the first epoch the proximal policy is the current one.
    `checkpoint_layers`: recompute layer activations in the backward pass (less memory, same values);
    None: when the micro-batch's activations would be large (`trainer.forward.CHECKPOINT_ABOVE_BYTES`)."""
    p = _pack(batch, idx, next(model.parameters()).device)
    pack = aux_pack_rows(cfg.pack_rows, cfg.moe_aux_loss_coef)
    with router_aux(model, cfg.moe_aux_loss_coef, [len(batch.rows[i].tokens) for i in idx]) as aux:
        sel = selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix, entropy=True,
                                checkpoint_layers=checkpoint_layers, pack=pack)  # fmt: skip
    behaviour = p.old_lp[sel.row, sel.pos]
    adv = p.adv[sel.row] if p.adv.dim() == 1 else p.adv[sel.row, sel.pos]
    w = p.weights[sel.row, sel.pos]
    start = sel.logprobs.detach() if prox is None else prox  # the trainer's policy before this update
    if cfg.tis_cap is None:
        base, iw = behaviour, torch.ones_like(behaviour)
    else:
        base, iw = start, tis_weight(start, behaviour, cfg.tis_cap)
    loss_t = iw * ppo_token_loss(sel.logprobs, base, adv, cfg.clip_low, cfg.clip_high)
    kl_sum = 0.0
    if cfg.kl_coef > 0:
        if ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        with torch.no_grad(), gathered(ref_model):
            ref_sel = selected_logprobs(ref_model, p.tokens, p.select, p.temps, p.prefix, pack=cfg.pack_rows)
            ref = ref_sel.logprobs
        kl = k3_kl(ref, sel.logprobs)
        loss_t = loss_t + cfg.kl_coef * kl
        kl_sum = float(kl.detach().sum())
    loss = (loss_t * w).sum() + aux.loss(w.sum())
    with torch.no_grad():
        ratio = torch.exp(sel.logprobs - base)
        behaviour_ratio = torch.exp(start - behaviour)  # exp(π − μ): engine/trainer gap, before any cap
        assert sel.entropy is not None
        stats = {
            "logprob_diff_max": float((start - behaviour).abs().max()),
            "tis_ratio_sum": float(behaviour_ratio.sum()),
            "tis_ratio_max": float(behaviour_ratio.max()),
            "tokens": float(ratio.numel()),
            "clipped": float(((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).sum()),
            "logprob_diff_abs": float((sel.logprobs - behaviour).abs().sum()),
            "ratio_sum": float(ratio.sum()),
            "entropy_sum": float(sel.entropy.sum()),
            "kl_sum": kl_sum,
            "tis_truncated": float((iw >= cfg.tis_cap).sum()) if cfg.tis_cap is not None else 0.0,
        }
    return loss, stats, sel.logprobs.detach()


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """A sharded reference's root unit gathered for its forward (`trainer.fsdp.shard_reference`; its layers
    gather themselves); nothing for an ordinary model."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def ppo_update(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: PPOConfig,
    ref_model: CausalLM | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    progress: Callable[[int, int], None] | None = None,
    checkpoint_layers: bool | None = None,
) -> dict[str, float]:
    """Run `cfg.epochs` optimizer steps over the batch, then step the LR schedule; returns loss and
    diagnostic metrics (of the last epoch; `mismatch` is mean |π − μ|, engine/trainer gap on epoch 1).
    `checkpoint_layers` trades a third more compute for most of the activation memory (same values);
    None (default) decides per micro-batch by its estimated activation bytes (`trainer.forward`).
    The update's memory is released before it returns (`release_memory`: gradients are None after).

    Rows whose advantage is exactly 0 (zero-variance groups kept with zero advantage, a common case with
    sparse rewards) add nothing to the loss or its gradient when there is no KL term: they are not
    run at all (their tokens still count in the other rows' normalisation, fixed in `batch.weights`).
    The token statistics are then over the rows that were run; `skipped_zero_adv_rows` counts the rest.
    If no row is left, no optimizer step is taken."""
    lr = optimizer.param_groups[0]["lr"]
    run_rows = rows_to_run(batch, cfg)
    skipped = float(len(batch.rows) - len(run_rows))
    if not run_rows or batch.n_trainable_tokens == 0:
        if scheduler is not None:
            with warnings.catch_warnings():  # the schedule advances per update, taken or not
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                scheduler.step()
        return {**NO_STEP_METRICS, "lr": lr, "skipped_zero_adv_rows": skipped}
    groups = row_groups(batch, run_rows, cfg.micro_batch_tokens)
    metrics = update_epochs(
        model, optimizer, groups, cfg,
        lambda idx, prox: micro_batch_loss(model, batch, idx, cfg, prox, ref_model, checkpoint_layers),
        progress=progress,
    )  # fmt: skip
    if scheduler is not None:
        scheduler.step()
    return {**metrics, "lr": lr, "skipped_zero_adv_rows": skipped}


# The loss of one micro-batch (its row indices, the proximal logprobs of epoch 1 or None): the
# differentiable loss, its token statistics, and its new logprobs (detached; None for no rows).
MicroBatchLoss = Callable[[list[int], Tensor | None], tuple[Tensor, dict[str, float], Tensor | None]]

NO_STEP_METRICS = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "mismatch": 0.0}


def rows_to_run(batch: Batch, cfg: PPOConfig) -> list[int]:
    """The rows an update runs: every row with a KL term, else the rows with a non-zero advantage."""
    return [i for i in range(len(batch.rows)) if cfg.kl_coef > 0 or batch.has_signal(i)]


def row_groups(batch: Batch, rows: list[int], token_budget: int) -> list[list[int]]:
    """The `micro_batches` of the batch's rows `rows`, as batch row indices."""
    local = micro_batches(
        [batch.rows[i].tokens for i in rows], [first_trainable(batch.rows[i].loss_mask) for i in rows],
        token_budget,
    )  # fmt: skip
    return [[rows[j] for j in idx] for idx in local]


def update_epochs(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    groups: list[list[int]],
    cfg: PPOConfig,
    loss_of: MicroBatchLoss,
    *,
    progress: Callable[[int, int], None] | None = None,
    no_sync: Callable[[], AbstractContextManager[object]] | None = None,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
    max_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> dict[str, float]:
    """The epoch loop of an update, shared by the single-process (`ppo_update`) and the data-parallel
    update (`trainer.distributed`): per epoch, the micro-batches' losses are backpropagated one by one
    (their gradients add up), then the gradient is clipped to `cfg.max_grad_norm` and one optimizer step
    is taken (skipped on a non-finite norm). Epoch 1's new logprobs are the proximal policy of the
    later epochs. Returns the last epoch's loss, gradient norm and token statistics.

    Data parallel: `no_sync` is entered around every micro-batch of an epoch but the last (DDP then
    reduces the gradients once, at the last backward), and `sum_over_ranks` sums the epoch's loss and
    statistics over the ranks before they are reported (`max_over_ranks` the statistics that are maxima)."""
    model.train()
    metrics: dict[str, float] = {}
    prox: list[Tensor | None] = [None] * len(groups)
    for epoch in range(cfg.epochs):
        optimizer.zero_grad(set_to_none=True)
        total_loss, agg = 0.0, dict.fromkeys((*_STAT_KEYS, *_MAX_KEYS), 0.0)
        for g, idx in enumerate(groups):
            last = g == len(groups) - 1
            with nullcontext() if last or no_sync is None else no_sync():
                loss, stats, new_lp = loss_of(idx, prox[g])
                trim_heap()  # the forward's freed transients go back before the backward allocates gradients
                loss.backward()
            trim_heap()
            if progress is not None:  # micro-batches done of all epochs'
                progress(epoch * len(groups) + g + 1, cfg.epochs * len(groups))
            if epoch == 0:
                prox[g] = new_lp
            total_loss += float(loss.detach())
            for k in _STAT_KEYS:
                agg[k] += stats[k]
            for k in _MAX_KEYS:
                agg[k] = max(agg[k], stats[k])
        if sum_over_ranks is not None:
            summed = sum_over_ranks([total_loss, *(agg[k] for k in _STAT_KEYS)])
            total_loss, agg = summed[0], {**agg, **dict(zip(_STAT_KEYS, summed[1:], strict=True))}
        if max_over_ranks is not None:
            agg.update(zip(_MAX_KEYS, max_over_ranks([agg[k] for k in _MAX_KEYS]), strict=True))
        # the parameters being trained: the model's, or a LoRA adapter's (the model's are then frozen)
        trained = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            optimizer.step()
        metrics = _epoch_metrics(total_loss, grad_norm, agg)
    model.eval()
    release_memory(model, optimizer)
    return metrics


def _epoch_metrics(total_loss: float, grad_norm: float, agg: dict[str, float]) -> dict[str, float]:
    """An epoch's loss, gradient norm and its per-token statistics."""
    n = max(agg["tokens"], 1.0)
    return {
        "loss": total_loss,
        "grad_norm": grad_norm,
        "clip_frac": agg["clipped"] / n,
        "mismatch": agg["logprob_diff_abs"] / n,
        "ratio_mean": agg["ratio_sum"] / n,
        "entropy": agg["entropy_sum"] / n,
        "kl": agg["kl_sum"] / n,
        "tis_truncated_frac": agg["tis_truncated"] / n,
        # engine vs trainer before the update (a precision mismatch shows here): max |π − μ| and the
        # behaviour ratio exp(π − μ) that TIS caps, mean and max
        "mismatch_max": agg["logprob_diff_max"],
        "tis_ratio_mean": agg["tis_ratio_sum"] / n,
        "tis_ratio_max": agg["tis_ratio_max"],
    }


def release_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give back what an update no longer needs: the gradients (the next update zeroes them anyway) and
    the heap glibc keeps after large frees (`malloc_trim`), so the resident size drops back. (The
    oneDNN path packs each weight per call and keeps no copies to release.)"""
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()


_STAT_KEYS = (
    "tokens",
    "clipped",
    "logprob_diff_abs",
    "ratio_sum",
    "entropy_sum",
    "kl_sum",
    "tis_truncated",
    "tis_ratio_sum",
)
_MAX_KEYS = ("logprob_diff_max", "tis_ratio_max")  # statistics taken as the maximum over micro-batches


def lr_lambda(
    schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> Callable[[int], float]:
    """The LR multiplier of update n (0-based): linear warmup over `warmup_steps`, then constant,
    linear decay or cosine decay to `min_ratio` at `total_steps`."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")

    def f(n: int) -> float:
        if n < warmup_steps:
            return (n + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(total_steps - warmup_steps, 1)
        frac = min(max((n - warmup_steps) / span, 0.0), 1.0)
        decay = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return min_ratio + (1.0 - min_ratio) * decay

    return f
