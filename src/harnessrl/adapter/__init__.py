"""Adapter: finished rollouts → rows with advantages and loss weights. Pure functions, no I/O."""

from harnessrl.adapter.advantage import (
    Estimator,
    group_advantages,
    rollout_advantages,
    sample_level_advantages,
)
from harnessrl.adapter.batch import AdvantageLevel, Batch, ZeroVariance, build_batch
from harnessrl.adapter.loss_weights import LossMode, loss_weights
from harnessrl.adapter.merge import BreakCause, MergeResult, MergeStats, Row, classify_break, merge_calls

__all__ = [
    "AdvantageLevel",
    "Batch",
    "BreakCause",
    "Estimator",
    "LossMode",
    "MergeResult",
    "MergeStats",
    "Row",
    "ZeroVariance",
    "build_batch",
    "classify_break",
    "group_advantages",
    "loss_weights",
    "merge_calls",
    "rollout_advantages",
    "sample_level_advantages",
]
