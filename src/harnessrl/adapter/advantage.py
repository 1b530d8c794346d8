"""Advantages: group statistics over rollouts (one reward each), broadcast to the rollout's rows.

For a group of n rollouts of one task with rewards r_1..r_n, mean m = (1/n) Σ r_j and population
standard deviation s = sqrt((1/n) Σ (r_j - m)^2):

- GRPO:     A_i = (r_i - m) / (s + eps)
- Dr.GRPO:  A_i = r_i - m
- RLOO:     A_i = r_i - (1/(n-1)) Σ_{j≠i} r_j  =  n/(n-1) · (r_i - m)   (0 when n = 1)

A group whose rewards are all equal has A_i = 0 exactly for every estimator (not the ~1e-10 that
float rounding of m would leave): the trainer skips such rows and counts them as zero-advantage.

Ablation only — "sample-level" advantage: the statistics are taken over rows instead of rollouts,
so a rollout with k rows counts k times: m' = Σ_r k_r r_r / Σ_r k_r, s' likewise, A = (r - m')/(s' + eps).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from enum import StrEnum

EPS = 1e-6


class Estimator(StrEnum):
    """Which group-relative advantage to use."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


def group_advantages(
    rewards: Sequence[float], estimator: Estimator = Estimator.GRPO, eps: float = EPS
) -> list[float]:
    """Advantages of one group's rollouts from their rewards (formulas in the module docstring)."""
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):  # no signal: exact zeros, whatever the rounding of the mean
        return [0.0] * n
    m = sum(rewards) / n
    if estimator == Estimator.GRPO:
        s = math.sqrt(sum((r - m) ** 2 for r in rewards) / n)
        return [(r - m) / (s + eps) for r in rewards]
    if estimator == Estimator.DR_GRPO:
        return [r - m for r in rewards]
    if estimator == Estimator.RLOO:
        return [n / (n - 1) * (r - m) if n > 1 else 0.0 for r in rewards]
    raise ValueError(f"unknown estimator {estimator!r}")


def _members(rewards: Mapping[str, float], groups: Mapping[str, str]) -> list[list[str]]:
    """The rollout ids of each group (in the order of `rewards`)."""
    members: dict[str, list[str]] = defaultdict(list)
    for rid in rewards:
        members[groups[rid]].append(rid)
    return list(members.values())


def rollout_advantages(
    rewards: Mapping[str, float], groups: Mapping[str, str], estimator: Estimator = Estimator.GRPO
) -> dict[str, float]:
    """Rollout-level advantages: statistics over the rollouts of each group, one value per rollout."""
    out: dict[str, float] = {}
    for rids in _members(rewards, groups):
        for rid, adv in zip(rids, group_advantages([rewards[r] for r in rids], estimator), strict=True):
            out[rid] = adv
    return out


def sample_level_advantages(
    rewards: Mapping[str, float],
    groups: Mapping[str, str],
    rows_per_rollout: Mapping[str, int],
    eps: float = EPS,
) -> dict[str, float]:
    """Ablation: GRPO statistics over rows (each rollout weighted by its row count), per rollout."""
    out: dict[str, float] = {}
    for rids in _members(rewards, groups):
        k = [rows_per_rollout.get(r, 0) for r in rids]
        total = sum(k)
        if total == 0 or len({rewards[r] for r in rids}) == 1:
            out.update({r: 0.0 for r in rids})
            continue
        m = sum(ki * rewards[r] for ki, r in zip(k, rids, strict=True)) / total
        s = math.sqrt(sum(ki * (rewards[r] - m) ** 2 for ki, r in zip(k, rids, strict=True)) / total)
        out.update({r: (rewards[r] - m) / (s + eps) for r in rids})
    return out
