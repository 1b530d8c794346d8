"""The PPO-clip policy update on a batch of rows, with the engine's logprobs as the behaviour policy.

Per trainable token t of a row with advantage A (the rollout's), new logprob π_t (recomputed by the
trainer at the row's sampling temperature) and old logprob μ_t (the engine's, recorded in the call):

    ρ_t = exp(π_t − μ_t)
    ℓ_t = −min(ρ_t · A, clip(ρ_t, 1 − ε_low, 1 + ε_high) · A)
    L   = Σ_t w_t · ℓ_t          (w_t: the adapter's loss weights, fixed for the whole batch)

The batch is cut into micro-batches by a token budget; their losses are summed into the gradient,
which therefore equals the whole batch's gradient. One optimizer step per epoch over the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from harnessrl.adapter import Batch
from harnessrl.modeling.llama import LlamaForCausalLM
from harnessrl.modeling.logprobs import next_token_logprobs


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


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group row indices (longest first) so each group's padded size B·max_len stays within budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass
class _Packed:
    tokens: Tensor  # [B, L]
    attention: Tensor  # [B, L]
    old_lp: Tensor  # [B, L-1], aligned with targets tokens[:, 1:]
    weights: Tensor  # [B, L-1]
    adv: Tensor  # [B, 1]
    temps: Tensor  # [B]


def _pack(batch: Batch, idx: list[int], device: torch.device) -> _Packed:
    length = max(len(batch.rows[i].tokens) for i in idx)
    b = len(idx)
    tokens = torch.zeros(b, length, dtype=torch.long)
    attention = torch.zeros(b, length, dtype=torch.long)
    old_lp = torch.zeros(b, length)
    weights = torch.zeros(b, length)
    for j, i in enumerate(idx):
        row, n = batch.rows[i], len(batch.rows[i].tokens)
        tokens[j, :n] = torch.tensor(row.tokens)
        attention[j, :n] = 1
        old_lp[j, :n] = torch.tensor(row.old_logprobs)
        weights[j, :n] = torch.tensor(batch.weights[i])
    adv = torch.tensor([batch.advantages[i] for i in idx]).unsqueeze(1)
    temps = torch.tensor([batch.rows[i].temperature for i in idx])
    return _Packed(
        tokens.to(device),
        attention.to(device),
        old_lp[:, 1:].to(device),
        weights[:, 1:].to(device),
        adv.to(device),
        temps.to(device),
    )


def micro_batch_loss(
    model: LlamaForCausalLM, batch: Batch, idx: list[int], cfg: PPOConfig
) -> tuple[Tensor, dict[str, float]]:
    """Σ w_t ℓ_t over the rows `idx` (a differentiable scalar) and statistics of those tokens."""
    p = _pack(batch, idx, next(model.parameters()).device)
    logits = model(p.tokens, attention_mask=p.attention)
    new_lp = next_token_logprobs(logits, p.tokens, p.temps)
    loss_t = ppo_token_loss(new_lp, p.old_lp, p.adv, cfg.clip_low, cfg.clip_high)
    loss = (loss_t * p.weights).sum()
    with torch.no_grad():
        mask = p.weights > 0
        ratio = torch.exp(new_lp - p.old_lp)[mask]
        stats = {
            "tokens": float(mask.sum()),
            "clipped": float(((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).sum()),
            "logprob_diff_abs": float((new_lp - p.old_lp)[mask].abs().sum()),
            "ratio_sum": float(ratio.sum()),
        }
    return loss, stats


def ppo_update(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: Batch, cfg: PPOConfig
) -> dict[str, float]:
    """Run `cfg.epochs` optimizer steps over the batch; returns loss and diagnostic metrics."""
    if not batch.rows or batch.n_trainable_tokens == 0:
        return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "mismatch": 0.0}
    groups = micro_batches([len(r.tokens) for r in batch.rows], cfg.micro_batch_tokens)
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
