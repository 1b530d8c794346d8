"""The PPO-clip policy update on a batch of rows, with the engine's logprobs as the behaviour policy.

Per trainable token t of a row with advantage A (the rollout's), new logprob π_t (recomputed by the
trainer at the row's sampling temperature) and old logprob μ_t (the engine's, recorded in the call):

    ρ_t = exp(π_t − μ_t)
    ℓ_t = −min(ρ_t · A, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)
    L   = Σ_t w_t · ℓ_t          (w_t: the adapter's loss weights, fixed for the whole batch)

The batch is cut into micro-batches by a token budget (rows with a common prefix together; see
`trainer.forward`); their losses are summed into the gradient, which therefore equals the whole
batch's gradient. One optimizer step per epoch over the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from harnessrl.adapter import Batch
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.trainer.forward import selected_logprobs, shareable_prefix


@dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of the update."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    epochs: int = 1


def ppo_token_loss(new_lp: Tensor, old_lp: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """ℓ_t = −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A) with ρ = exp(new − old), elementwise."""
    ratio = torch.exp(new_lp - old_lp)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * adv, clipped * adv)


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
    adv: Tensor  # [B]
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
        adv=torch.tensor([batch.advantages[i] for i in idx], device=device),
        temps=torch.tensor([r.temperature for r in rows], device=device),
        prefix=prefix,
    )


def micro_batch_loss(
    model: LlamaForCausalLM, batch: Batch, idx: list[int], cfg: PPOConfig
) -> tuple[Tensor, dict[str, float]]:
    """Σ w_t ℓ_t over the rows `idx` (a differentiable scalar) and statistics of those tokens."""
    p = _pack(batch, idx, next(model.parameters()).device)
    sel = selected_logprobs(model, p.tokens, p.select, p.temps, p.prefix)
    old = p.old_lp[sel.row, sel.pos]
    loss_t = ppo_token_loss(sel.logprobs, old, p.adv[sel.row], cfg.clip_low, cfg.clip_high)
    loss = (loss_t * p.weights[sel.row, sel.pos]).sum()
    with torch.no_grad():
        ratio = torch.exp(sel.logprobs - old)
        stats = {
            "tokens": float(ratio.numel()),
            "clipped": float(((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).sum()),
            "logprob_diff_abs": float((sel.logprobs - old).abs().sum()),
            "ratio_sum": float(ratio.sum()),
        }
    return loss, stats


def ppo_update(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: Batch, cfg: PPOConfig
) -> dict[str, float]:
    """Run `cfg.epochs` optimizer steps over the batch; returns loss and diagnostic metrics."""
    if not batch.rows or batch.n_trainable_tokens == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "mismatch": 0.0}
    groups = micro_batches(
        [r.tokens for r in batch.rows],
        [first_trainable(r.loss_mask) for r in batch.rows],
        cfg.micro_batch_tokens,
    )
    model.train()
    metrics: dict[str, float] = {}
    for _ in range(cfg.epochs):
        optimizer.zero_grad(set_to_none=True)
        total_loss, agg = 0.0, {"tokens": 0.0, "clipped": 0.0, "logprob_diff_abs": 0.0, "ratio_sum": 0.0}
        for idx in groups:
            loss, stats = micro_batch_loss(model, batch, idx, cfg)
            loss.backward()
            total_loss += float(loss.detach())
            for k in agg:
                agg[k] += stats[k]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            optimizer.step()
        n = max(agg["tokens"], 1.0)
        metrics = {
            "loss": total_loss,
            "grad_norm": grad_norm,
            "clip_frac": agg["clipped"] / n,
            "mismatch": agg["logprob_diff_abs"] / n,  # mean |π − μ|: engine/trainer mismatch on epoch 1
            "ratio_mean": agg["ratio_sum"] / n,
        }
    model.eval()
    return metrics
