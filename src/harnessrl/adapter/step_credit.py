"""Step credit: per-call rewards on top of the rollout-level advantage (`train.credit: step`). Pure.

A grader may return, besides a rollout's reward r_i, step rewards s_{i,k} for some of its calls, named
by position k (0 = the graded attempt's first model call) or by a tool call the call's answer made; a
harness's annotations with a `value` count too when its task says `allow_annotation_rewards`. Several
step rewards on one call add up. For a group of rollouts i = 1..n with rollout-level advantages A_i
(GRPO, Dr.GRPO or RLOO, exactly as `adapter.advantage` computes them), and for each step k:

    G_k = { j in the group : rollout j has a step reward at step k }
    b_k = (1/|G_k|) Σ_{j ∈ G_k} s_{j,k}                       (turn-level baseline across the group)
    A_{i,k} = A_i + β · (s_{i,k} − b_k)   if i ∈ G_k,   else A_i

and every token that call k of rollout i sampled is trained with A_{i,k} (β = `train.step_coef`).

Why it keeps the rollout-level design: the group statistics of A_i are still over rollouts (one reward
each), the loss weights (`adapter.loss_weights`, rollout-token-mean by default) are not touched, and at
every step the turn-level term sums to zero over the group, Σ_{i ∈ G_k} (s_{i,k} − b_k) = 0, so it only
moves credit between siblings' calls at the same step and never adds a push common to the group. A step
reward that no sibling has at that step (|G_k| = 1) has nothing to be compared with: its term is 0, as
a group whose rewards are all equal gets advantage 0. With no step rewards A_{i,k} = A_i exactly, the
rollout-only estimator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from harnessrl.adapter.merge import Row
from harnessrl.schema import Call, RolloutDetail, StepReward


class Credit(StrEnum):
    """How advantages reach tokens: one per rollout (default), or per call with step rewards."""

    ROLLOUT = "rollout"
    STEP = "step"


@dataclass
class StepReport:
    """What step credit found in a batch."""

    step_rewards: int = 0  # step rewards that named a call of their rollout's graded attempt
    from_annotations: int = 0  # of those, annotations a task allowed as rewards
    unmatched: int = 0  # step rewards naming no call of the graded attempt (position or tool call)
    credited_calls: int = 0  # calls whose turn-level term is not 0
    ignored_annotations: int = 0  # annotations with a value that their task does not allow as rewards

    def as_dict(self) -> dict[str, int]:
        """JSON-ready counts."""
        return dict(self.__dict__)


@dataclass
class CallSpan:
    """Where a call's completion sits in its row (a row's tokens start with the call's prompt), and its
    turn-level term β · (s − b)."""

    start: int
    end: int
    term: float


@dataclass
class StepCredit:
    """Per rollout: the turn-level term of each credited call, by call id."""

    spans: dict[str, dict[str, CallSpan]] = field(default_factory=dict)
    report: StepReport = field(default_factory=StepReport)


def attempt_calls(detail: RolloutDetail) -> list[Call]:
    """The calls of the rollout's graded (last) attempt, in order: the positions step rewards name."""
    last = max((a.attempt for a in detail.attempts), default=0)
    return [c for c in detail.calls if c.attempt == last]


def _tool_call_positions(calls: Sequence[Call]) -> dict[str, int]:
    """The position of the call whose answer made each tool call, by tool call id."""
    out: dict[str, int] = {}
    for k, call in enumerate(calls):
        _, _, answer = call.conversation()
        for tc in (answer or {}).get("tool_calls") or []:
            if isinstance(tc, dict) and isinstance(tc.get("id"), str):
                out.setdefault(tc["id"], k)
    return out


def step_rewards(detail: RolloutDetail, report: StepReport | None = None) -> dict[int, float]:
    """The rollout's step rewards by call position: the grader's, plus its annotations' values when the
    task allows them (`allow_annotation_rewards` in the rollout's metadata). Targets that name no call
    of the graded attempt are counted in `report.unmatched` and left out."""
    report = report if report is not None else StepReport()
    calls = attempt_calls(detail)
    by_tool = _tool_call_positions(calls)
    wanted: list[tuple[StepReward, bool]] = [
        (s, False) for s in (detail.reward.steps if detail.reward else [])
    ]
    allowed = detail.rollout.metadata.get("allow_annotation_rewards") is True
    for a in detail.annotations:
        if a.value is None:
            continue
        if allowed:
            wanted.append((a, True))
        else:
            report.ignored_annotations += 1
    out: dict[int, float] = defaultdict(float)
    for s, annotated in wanted:
        k = s.call if s.call is not None else by_tool.get(s.tool_call_id or "")
        if k is None or k >= len(calls) or s.value is None:
            report.unmatched += 1
            continue
        out[k] += s.value
        report.step_rewards += 1
        report.from_annotations += annotated
    return dict(out)


def turn_terms(
    steps: Mapping[str, Mapping[int, float]], groups: Mapping[str, str], coef: float = 1.0
) -> dict[str, dict[int, float]]:
    """β · (s_{i,k} − b_k) for every rollout i and step k it has a step reward at (module docstring)."""
    at: dict[tuple[str, int], list[str]] = defaultdict(list)
    for rid, per_call in steps.items():
        for k in per_call:
            at[(groups[rid], k)].append(rid)
    out: dict[str, dict[int, float]] = {rid: {} for rid in steps}
    for (_, k), rids in at.items():
        values = [steps[r][k] for r in rids]
        if max(values) == min(values):  # |G_k| = 1 or all equal: exactly 0, whatever the rounding
            continue
        b = sum(values) / len(values)
        for rid, s in zip(rids, values, strict=True):
            out[rid][k] = coef * (s - b)
    return out


def step_credit(details: Sequence[RolloutDetail], groups: Mapping[str, str], coef: float = 1.0) -> StepCredit:
    """The turn-level terms of the graded rollouts `groups` names, placed on their calls' completions."""
    credit = StepCredit()
    used = [d for d in details if d.rollout.rollout_id in groups]
    steps = {d.rollout.rollout_id: step_rewards(d, credit.report) for d in used}
    terms = turn_terms(steps, groups, coef)
    for d in used:
        rid = d.rollout.rollout_id
        calls = attempt_calls(d)
        spans: dict[str, CallSpan] = {}
        for k, term in terms[rid].items():
            c = calls[k]
            spans[c.call_id] = CallSpan(len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids), term)
            credit.report.credited_calls += term != 0.0
        credit.spans[rid] = spans
    return credit


def row_token_advantages(row: Row, advantage: float, spans: Mapping[str, CallSpan]) -> list[float]:
    """Per-token advantages of a row: the rollout's `advantage`, plus each credited call's term on the
    tokens its completion sampled (a row cut by the length limit keeps the terms of what is left)."""
    out = [advantage] * len(row.tokens)
    for call_id in row.call_ids:
        span = spans.get(call_id)
        if span is None:
            continue
        for t in range(span.start, min(span.end, len(out))):
            out[t] = advantage + span.term
    return out


def has_step_signal(spans: Mapping[str, CallSpan]) -> bool:
    """Whether any call of a rollout has a non-zero turn-level term."""
    return any(s.term != 0.0 for s in spans.values())
