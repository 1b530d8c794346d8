"""From finished rollouts to a training batch: merge → advantages → loss weights. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from harnessrl.adapter.advantage import Estimator, rollout_advantages, sample_level_advantages
from harnessrl.adapter.length import LengthReport, StalenessReport, apply_length_limit, filter_stale
from harnessrl.adapter.loss_weights import LossMode, loss_weights
from harnessrl.adapter.merge import MergeStats, Row, merge_calls
from harnessrl.adapter.step_credit import (
    Credit,
    StepCredit,
    StepReport,
    has_step_signal,
    row_token_advantages,
    step_credit,
)
from harnessrl.schema import RolloutDetail, RolloutState


class ZeroVariance(StrEnum):
    """What to do with a group whose rollouts all got the same reward (every advantage is 0)."""

    KEEP = "keep"  # train on its rows with advantage 0: they add nothing to the policy gradient but
    #                count in the normalisation (and in a KL or entropy term)
    DROP = "drop"  # leave its rows out of the batch


class AdvantageLevel(StrEnum):
    """Where group statistics are taken: over rollouts (correct) or over rows (ablation)."""

    ROLLOUT = "rollout"
    SAMPLE = "sample"


@dataclass
class Batch:
    """Rows ready for the policy update, each with its advantage and per-token loss weights."""

    rows: list[Row]
    advantages: list[float]
    weights: list[list[float]]
    rewards: dict[str, float]
    stats: MergeStats = field(default_factory=MergeStats)
    groups: int = 0  # groups with at least one graded rollout
    zero_variance_groups: int = 0  # of those, groups whose rewards were all equal
    dropped_rows: int = 0  # rows left out because their group had zero variance (ZeroVariance.DROP)
    length: LengthReport = field(default_factory=LengthReport)  # rows cut or dropped by the length limit
    staleness: StalenessReport = field(default_factory=StalenessReport)  # rows per staleness, dropped
    # Credit.STEP: each row's per-token advantages (`adapter.step_credit`; `advantages` then holds the
    # rollout-level part); None: every token of a row has its row's advantage
    token_advantages: list[list[float]] | None = None
    steps: StepReport = field(default_factory=StepReport)
    # graded rollouts whose grader flagged reward hacking (`details["hacking"]` set: tests edited, ...)
    flagged_hacking: list[str] = field(default_factory=list)

    def has_signal(self, i: int) -> bool:
        """Whether row `i` has a non-zero advantage on some token (else its policy gradient is 0)."""
        if self.token_advantages is None:
            return self.advantages[i] != 0.0
        return any(
            a != 0.0 for a, m in zip(self.token_advantages[i], self.rows[i].loss_mask, strict=True) if m
        )

    def policy_rows(self) -> dict[str | None, list[int]]:
        """The indices of the rows of each policy (several policies; {None: all} with one)."""
        out: dict[str | None, list[int]] = {}
        for i, row in enumerate(self.rows):
            out.setdefault(row.policy, []).append(i)
        return out

    def select(self, indices: list[int]) -> Batch:
        """The batch of rows `indices` only, with their advantages and loss weights as computed on the
        whole batch (so the update of one policy's rows is the whole loss's gradient for its adapter)."""
        return dataclasses.replace(
            self,
            rows=[self.rows[i] for i in indices],
            advantages=[self.advantages[i] for i in indices],
            weights=[self.weights[i] for i in indices],
            token_advantages=None
            if self.token_advantages is None
            else [self.token_advantages[i] for i in indices],
        )

    @property
    def n_trainable_tokens(self) -> int:
        """Tokens with loss mask 1 in the batch."""
        return sum(r.n_trainable for r in self.rows)


def _limited(
    rows: list[Row], version: int | None, max_staleness: int | None, max_row_tokens: int | None
) -> tuple[list[Row], StalenessReport, LengthReport]:
    """Rows staler than `max_staleness` at weight `version` dropped, then rows past `max_row_tokens` cut."""
    staleness = StalenessReport()
    if version is not None:
        rows, staleness = filter_stale(rows, version, max_staleness)
    rows, length = apply_length_limit(rows, max_row_tokens)
    return rows, staleness, length


def _flat_groups(
    members: dict[str, list[str]], rewards: dict[str, float], credit_of: StepCredit | None
) -> set[str]:
    """Groups whose rewards are all equal (and, under step credit, whose calls got no step term): no
    learning signal."""
    return {
        gid
        for gid, rids in members.items()
        if max(rewards[r] for r in rids) - min(rewards[r] for r in rids) <= 1e-12
        and not (credit_of and any(has_step_signal(credit_of.spans[r]) for r in rids))
    }


def build_batch(
    details: Sequence[RolloutDetail],
    level: AdvantageLevel = AdvantageLevel.ROLLOUT,
    estimator: Estimator = Estimator.GRPO,
    loss_mode: LossMode = LossMode.ROLLOUT_TOKEN_MEAN,
    zero_variance: ZeroVariance = ZeroVariance.KEEP,
    max_row_tokens: int | None = None,
    version: int | None = None,
    max_staleness: int | None = None,
    include_failed_attempts: bool = False,
    merge: bool = True,
    credit: Credit = Credit.ROLLOUT,
    step_coef: float = 1.0,
) -> Batch:
    """Turn graded rollouts into a batch. Rollouts without a reward are left out; only the calls of a
    rollout's last attempt are used (earlier attempts died for infrastructure reasons; with
    `include_failed_attempts` each attempt's calls become rows of their own). Groups whose
    rewards are all equal are counted, and kept with advantage 0 or dropped (`zero_variance`); the
    advantages of the other groups do not depend on that choice (statistics are per group).

    Then rows staler than `max_staleness` at weight `version` are dropped and rows longer than
    `max_row_tokens` cut (rules in `adapter.length`); loss weights are computed on what remains, and
    every row of a rollout keeps that rollout's advantage. With `merge` False every call is a row of its
    own (no token-prefix merging: the transitions of Agent Lightning, for ablations).

    With `credit` STEP the grader's step rewards (and allowed annotations) add a turn-level term to the
    tokens of the calls they name (`adapter.step_credit`, scaled by `step_coef`); a group whose rewards
    are all equal then counts as zero-variance only if none of its calls got a term either."""
    stats, rows_of, rewards, groups = _graded_rows(details, include_failed_attempts, merge)
    details_by_id = {d.rollout.rollout_id: d for d in details}
    if level == AdvantageLevel.ROLLOUT:
        adv = rollout_advantages(rewards, groups, estimator)
    else:
        adv = sample_level_advantages(rewards, groups, {r: len(v) for r, v in rows_of.items()})
    members: dict[str, list[str]] = {}
    for rid, gid in groups.items():
        members.setdefault(gid, []).append(rid)
    credit_of = step_credit(details, groups, step_coef) if credit == Credit.STEP else None
    flat = _flat_groups(members, rewards, credit_of)
    dropped = {gid for gid in flat if zero_variance == ZeroVariance.DROP}
    rows = [row for rid, rs in rows_of.items() if groups[rid] not in dropped for row in rs]
    zero_var_dropped = sum(len(v) for v in rows_of.values()) - len(rows)
    rows, staleness, length = _limited(rows, version, max_staleness, max_row_tokens)
    return Batch(
        rows=rows,
        advantages=[adv[r.rollout_id] for r in rows],
        weights=loss_weights(rows, loss_mode),
        rewards=rewards,
        stats=stats,
        groups=len(members),
        zero_variance_groups=len(flat),
        dropped_rows=zero_var_dropped,
        length=length,
        staleness=staleness,
        token_advantages=None
        if credit_of is None
        else [row_token_advantages(r, adv[r.rollout_id], credit_of.spans[r.rollout_id]) for r in rows],
        steps=credit_of.report if credit_of else StepReport(),
        flagged_hacking=[rid for rid in rewards if _hacking(details_by_id[rid])],
    )


def _graded_rows(
    details: Sequence[RolloutDetail], include_failed_attempts: bool, merge: bool
) -> tuple[MergeStats, dict[str, list[Row]], dict[str, float], dict[str, str]]:
    """The rows, reward and group of every graded rollout (see `build_batch`), with merge statistics."""
    stats = MergeStats()
    rows_of: dict[str, list[Row]] = {}
    rewards: dict[str, float] = {}
    groups: dict[str, str] = {}
    for d in details:
        if d.reward is None or d.rollout.state != RolloutState.SUCCEEDED:
            continue
        rid = d.rollout.rollout_id
        last = max((a.attempt for a in d.attempts), default=0)
        used = sorted({c.attempt for c in d.calls}) if include_failed_attempts else [last]
        rows_of[rid] = []
        for attempt in used:
            result = merge_calls([c for c in d.calls if c.attempt == attempt], merge=merge)
            stats.add(result)
            rows_of[rid].extend(result.rows)
        rewards[rid] = d.reward.value
        groups[rid] = d.rollout.group_id or rid
    return stats, rows_of, rewards, groups


def _hacking(detail: RolloutDetail) -> bool:
    """Whether the grader flagged the rollout as gaming its reward (a non-empty `hacking` detail)."""
    return bool(detail.reward is not None and detail.reward.details.get("hacking"))
