"""Per-token loss weights: the normalisation of the policy loss, computed on the whole batch.

The batch loss is L = Σ_rows Σ_t w_t · ℓ_t, with w_t = 0 wherever the loss mask is 0. With R
rollouts (that have at least one trainable token), N rows, T_r trainable tokens of rollout r over all
its rows, T_n trainable tokens of row n and T trainable tokens in the batch:

- rollout-token-mean (default):  w_t = 1 / (R · T_r)   →  L = (1/R) Σ_r (1/T_r) Σ_{t∈r} ℓ_t
- token-mean:                    w_t = 1 / T           →  L = (1/T) Σ_t ℓ_t
- sample-mean (ablation):        w_t = 1 / (N · T_n)   →  L = (1/N) Σ_n (1/T_n) Σ_{t∈n} ℓ_t

Only rows and rollouts with at least one trainable token count in R, N and the T's: a rollout whose
calls were all dropped (failed, empty completions) changes no denominator. Because the weights are
fixed before micro-batching, summing Σ w_t ℓ_t over k micro-batches gives
exactly the gradient of the whole batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

from harnessrl.adapter.merge import Row


class LossMode(StrEnum):
    """How per-token losses are averaged into the batch loss."""

    ROLLOUT_TOKEN_MEAN = "rollout_token_mean"
    TOKEN_MEAN = "token_mean"
    SAMPLE_MEAN = "sample_mean"


def loss_weights(rows: Sequence[Row], mode: LossMode = LossMode.ROLLOUT_TOKEN_MEAN) -> list[list[float]]:
    """Per-token weights for every row (formulas in the module docstring)."""
    trainable = [r for r in rows if r.n_trainable > 0]
    if not trainable:
        return [[0.0] * len(r.tokens) for r in rows]
    if mode == LossMode.ROLLOUT_TOKEN_MEAN:
        per_rollout: Counter[str] = Counter()
        for r in trainable:
            per_rollout[r.rollout_id] += r.n_trainable
        n_rollouts = len(per_rollout)
        return [
            [m / (n_rollouts * per_rollout[r.rollout_id]) if m else 0.0 for m in r.loss_mask] for r in rows
        ]
    if mode == LossMode.TOKEN_MEAN:
        total = sum(r.n_trainable for r in trainable)
        return [[m / total if m else 0.0 for m in r.loss_mask] for r in rows]
    if mode == LossMode.SAMPLE_MEAN:
        n_rows = len(trainable)
        return [[m / (n_rows * r.n_trainable) if m else 0.0 for m in r.loss_mask] for r in rows]
    raise ValueError(f"unknown loss mode {mode!r}")
