"""Adapter: finished rollouts → rows with advantages and loss weights. Pure functions, no I/O."""

from harnessrl.adapter.advantage import (
    Estimator,
    group_advantages,
    rollout_advantages,
    sample_level_advantages,
)
from harnessrl.adapter.batch import AdvantageLevel, Batch, ZeroVariance, build_batch
from harnessrl.adapter.length import (
    LengthReport,
    StalenessReport,
    apply_length_limit,
    filter_stale,
    row_staleness,
    truncate_row,
)
from harnessrl.adapter.loss_weights import LossMode, loss_weights
from harnessrl.adapter.merge import BreakCause, MergeResult, MergeStats, Row, classify_break, merge_calls
from harnessrl.adapter.step_credit import Credit, StepReport, step_credit, turn_terms

__all__ = [
    "AdvantageLevel",
    "Batch",
    "BreakCause",
    "Credit",
    "Estimator",
    "LengthReport",
    "LossMode",
    "MergeResult",
    "MergeStats",
    "Row",
    "StalenessReport",
    "StepReport",
    "ZeroVariance",
    "apply_length_limit",
    "build_batch",
    "classify_break",
    "filter_stale",
    "group_advantages",
    "loss_weights",
    "merge_calls",
    "rollout_advantages",
    "row_staleness",
    "sample_level_advantages",
    "step_credit",
    "truncate_row",
    "turn_terms",
]
