"""Step credit: per-call rewards on top of the rollout-level advantage (`train.credit: step`). Pure.

A grader may return, besides a rollout's reward r_i, step rewards s_{i,k} for some of its calls, named
by position k (0 = the graded attempt's first model call) or by a tool call the call's answer made; a
harness's annotations with a `value` count too when its task says `allow_annotation_rewards`. Several
step rewards on one call add up.

Calls are paired across a group by what they are, not by their index (`call_keys`): in a variable-length
agent run the third call of one rollout and the third of its sibling can be different sub-tasks. Each
call gets a key κ(i, k):

- the harness's own step: `calls_per_step` in the reward's details (n_0 calls for step 0, then n_1 for
  step 1, ...), or `details["step"]` on a step reward or annotation of the call: κ = (step, j) for the
  j-th call of that step;
- otherwise what the call answers: κ = (its system messages and last user message, j) for the j-th call
  of its rollout answering that same instruction (a tool loop's calls share their user message and are
  told apart by j; a sub-agent has its own system message);
- `Pairing.POSITION` keeps the old key κ = k, for ablation.

For a group of rollouts i = 1..n with rollout-level advantages A_i (GRPO, Dr.GRPO or RLOO, exactly as
`adapter.advantage` computes them), and for each key κ:

    G_κ = { j in the group : rollout j has a step reward at a call keyed κ }
    b_κ = (1/|G_κ|) Σ_{j ∈ G_κ} s_{j,κ}                       (turn-level baseline across the group)
    A_{i,k} = A_i + β · (s_{i,κ(i,k)} − b_κ)   if i ∈ G_κ,   else A_i

and every token that call k of rollout i sampled is trained with A_{i,k} (β = `train.step_coef`).

Why it keeps the rollout-level design: the group statistics of A_i are still over rollouts (one reward
each), the loss weights (`adapter.loss_weights`, rollout-token-mean by default) are not touched, and for
every key the turn-level term sums to zero over the group, Σ_{i ∈ G_κ} (s_{i,κ} − b_κ) = 0, so it only
moves credit between siblings' calls that do the same thing and never adds a push common to the group. A
step reward on a call no sibling has a counterpart of (|G_κ| = 1) has nothing to be compared with: its
term is 0 (counted as `unpaired`), rather than a comparison with an unrelated call. With no step rewards
A_{i,k} = A_i exactly, the rollout-only estimator.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harnessrl.adapter.merge import Row
from harnessrl.schema import Call, RolloutDetail, StepReward


class Pairing(StrEnum):
    """How calls of sibling rollouts are paired: by the harness's steps or their prompts (`auto`), or
    by position (`position`, the old way, for ablation)."""

    AUTO = "auto"
    POSITION = "position"


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
    unpaired: int = 0  # step rewards on a call no sibling has a counterpart of (term 0)
    paired_by_step: int = 0  # calls keyed by the harness's own step (the rest: by their prompt)
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


def call_keys(detail: RolloutDetail, pairing: Pairing = Pairing.AUTO) -> list[Hashable]:
    """The pairing key κ of each call of the graded attempt, by position (module docstring)."""
    calls = attempt_calls(detail)
    if pairing == Pairing.POSITION:
        return list(range(len(calls)))
    steps = harness_steps(detail)
    seen: dict[tuple[str, str], int] = defaultdict(int)
    out: list[Hashable] = []
    for k, call in enumerate(calls):
        base = ("step", steps[k]) if k in steps else ("prompt", _instruction(call))
        out.append((*base, seen[base]))
        seen[base] += 1
    return out


def harness_steps(detail: RolloutDetail) -> dict[int, str]:
    """The harness's own step of each call position it names: `calls_per_step` in the reward's details,
    then `details["step"]` of the rollout's step rewards and annotations (these win)."""
    calls = attempt_calls(detail)
    out: dict[int, str] = {}
    per = detail.reward.details.get("calls_per_step") if detail.reward else None
    if isinstance(per, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in per):
        positions = [str(step) for step, count in enumerate(per) for _ in range(count)]
        out.update({k: step for k, step in enumerate(positions[: len(calls)])})
    by_tool = _tool_call_positions(calls)
    for s in [*(detail.reward.steps if detail.reward else []), *detail.annotations]:
        step = s.details.get("step")
        k = s.call if s.call is not None else by_tool.get(s.tool_call_id or "")
        if isinstance(step, str | int) and not isinstance(step, bool) and k is not None and k < len(calls):
            out[k] = str(step)
    return out


def _instruction(call: Call) -> str:
    """What a call answers: a digest of its system messages and its last user message (calls without
    chat messages, raw completions, share one: they pair by their order)."""
    messages, _, _ = call.conversation()
    system = [
        m.get("content") for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")
    ]
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    text = json.dumps([system, users[-1:]], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def turn_terms(
    steps: Mapping[str, Mapping[Any, float]], groups: Mapping[str, str], coef: float = 1.0
) -> dict[str, dict[Any, float]]:
    """β · (s_{i,κ} − b_κ) for every rollout i and key κ it has a step reward at (module docstring)."""
    at: dict[tuple[str, Any], list[str]] = defaultdict(list)
    for rid, per_call in steps.items():
        for key in per_call:
            at[(groups[rid], key)].append(rid)
    out: dict[str, dict[Any, float]] = {rid: {} for rid in steps}
    for (_, key), rids in at.items():
        values = [steps[r][key] for r in rids]
        if max(values) == min(values):  # |G_κ| = 1 or all equal: exactly 0, whatever the rounding
            continue
        b = sum(values) / len(values)
        for rid, s in zip(rids, values, strict=True):
            out[rid][key] = coef * (s - b)
    return out


def unpaired(steps: Mapping[str, Mapping[Any, float]], groups: Mapping[str, str]) -> int:
    """How many step rewards sit on a call that no sibling has a counterpart with a step reward of."""
    count: dict[tuple[str, Any], int] = defaultdict(int)
    for rid, per_call in steps.items():
        for key in per_call:
            count[(groups[rid], key)] += 1
    return sum(n == 1 for n in count.values())


def step_credit(
    details: Sequence[RolloutDetail],
    groups: Mapping[str, str],
    coef: float = 1.0,
    pairing: Pairing = Pairing.AUTO,
) -> StepCredit:
    """The turn-level terms of the graded rollouts `groups` names, placed on their calls' completions."""
    credit = StepCredit()
    used = [d for d in details if d.rollout.rollout_id in groups]
    keys = {d.rollout.rollout_id: call_keys(d, pairing) for d in used}
    steps: dict[str, dict[Any, float]] = {}
    for d in used:
        rid = d.rollout.rollout_id
        steps[rid] = {keys[rid][k]: v for k, v in step_rewards(d, credit.report).items()}
        credit.report.paired_by_step += sum(isinstance(key, tuple) and key[0] == "step" for key in keys[rid])
    terms = turn_terms(steps, groups, coef)
    credit.report.unpaired += unpaired(steps, groups)
    for d in used:
        rid = d.rollout.rollout_id
        spans: dict[str, CallSpan] = {}
        for c, key in zip(attempt_calls(d), keys[rid], strict=True):
            term = terms[rid].get(key)
            if term is None:
                continue
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
