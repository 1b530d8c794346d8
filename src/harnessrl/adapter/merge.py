"""Merge a rollout's calls into rows (training samples) by exact token prefix. Pure functions.

Rule: calls are taken in order. A call extends an open row of its rollout when its `prompt_ids` start
with that row's tokens (`prompt_ids + completion_ids` of the calls merged so far) exactly; when
several open rows qualify, the longest one wins. The extra prompt tokens (tool output, new user
turns) enter the row with loss mask 0, the completion with mask 1 and the engine's logprobs. A call
that extends no open row starts a new row, and the break is recorded with one cause:

- `history_edited`: the call's messages do not extend the previous call's messages + its answer;
- `template_change`: the messages extend, but the tools or the sampling temperature changed;
- `truncation`: the previous completion was cut by the length limit;
- `policy_change`: the call was served by another policy (several policies: a row trains one adapter);
- `retokenized`: the messages extend, yet the tokens do not (text re-encoded differently).

Calls that cannot enter a row are left out before merging (`usable`): failed calls, calls with an
empty completion (nothing was sampled, so nothing can be trained on), and calls whose logprobs do not
match their completion token by token.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from harnessrl.chat import normalize_message
from harnessrl.schema import Call, CallStatus


class BreakCause(StrEnum):
    """Why a call could not be merged into an existing row."""

    HISTORY_EDITED = "history_edited"
    RETOKENIZED = "retokenized"
    TEMPLATE_CHANGE = "template_change"
    TRUNCATION = "truncation"
    POLICY_CHANGE = "policy_change"


@dataclass
class Row:
    """A training sample: one token sequence of one rollout with its loss mask and old logprobs."""

    rollout_id: str
    tokens: list[int]
    loss_mask: list[int]  # 1 on tokens the model sampled, 0 on prompt/observation tokens
    old_logprobs: list[float]  # the engine's logprob where loss_mask is 1, else 0.0
    temperature: float
    call_ids: list[str] = field(default_factory=list)
    weight_versions: list[int | None] = field(default_factory=list)
    policy: str | None = None  # several policies: the one whose adapter its calls trained (None: the one)

    @property
    def n_trainable(self) -> int:
        """Number of tokens with loss mask 1."""
        return sum(self.loss_mask)


@dataclass
class MergeResult:
    """Rows of one rollout and the causes of every break between its calls."""

    rows: list[Row]
    breaks: list[BreakCause]
    n_calls: int


def _new_row(call: Call) -> Row:
    return Row(
        rollout_id=call.rollout_id,
        tokens=list(call.prompt_ids) + list(call.completion_ids),
        loss_mask=[0] * len(call.prompt_ids) + [1] * len(call.completion_ids),
        old_logprobs=[0.0] * len(call.prompt_ids) + list(call.completion_logprobs),
        temperature=call.temperature,
        call_ids=[call.call_id],
        weight_versions=[call.weight_version],
        policy=call.policy,
    )


def _extend(row: Row, call: Call) -> None:
    extra = call.prompt_ids[len(row.tokens) :]
    row.tokens += list(extra) + list(call.completion_ids)
    row.loss_mask += [0] * len(extra) + [1] * len(call.completion_ids)
    row.old_logprobs += [0.0] * len(extra) + list(call.completion_logprobs)
    row.call_ids.append(call.call_id)
    row.weight_versions.append(call.weight_version)


def _extends(row: Row, call: Call) -> bool:
    n = len(row.tokens)
    return (
        row.temperature == call.temperature
        and row.policy == call.policy
        and len(call.prompt_ids) >= n
        and call.prompt_ids[:n] == row.tokens
    )


def usable(call: Call) -> bool:
    """A call can enter a row: it succeeded and its completion has one logprob per token."""
    return (
        call.status == CallStatus.OK
        and len(call.completion_ids) > 0
        and len(call.completion_ids) == len(call.completion_logprobs)
    )


def merge_calls(calls: Sequence[Call], merge: bool = True) -> MergeResult:
    """Merge one rollout's calls (in order) into rows; see the module docstring for the rule. With
    `merge` False every usable call becomes a row of its own (no breaks are counted: nothing was tried)."""
    rows: list[Row] = []
    breaks: list[BreakCause] = []
    kept = [c for c in calls if usable(c)]
    if not merge:
        return MergeResult(rows=[_new_row(c) for c in kept], breaks=[], n_calls=len(kept))
    prev: Call | None = None
    for call in kept:
        candidates = [r for r in rows if _extends(r, call)]
        if candidates:
            _extend(max(candidates, key=lambda r: len(r.tokens)), call)
        else:
            if prev is not None:
                breaks.append(classify_break(prev, call))
            rows.append(_new_row(call))
        prev = call
    return MergeResult(rows=rows, breaks=breaks, n_calls=len(kept))


def classify_break(prev: Call, call: Call) -> BreakCause:
    """The cause of a break between `prev` and `call`, read from their recorded messages and tokens."""
    if prev.policy != call.policy:
        return BreakCause.POLICY_CHANGE
    prev_msgs, prev_tools, answer = prev.conversation()
    new_msgs, new_tools, _ = call.conversation()
    expected = [normalize_message(m) for m in prev_msgs]
    if answer is not None:
        expected.append(normalize_message(answer))
    if [normalize_message(m) for m in new_msgs[: len(expected)]] != expected:
        return BreakCause.HISTORY_EDITED
    if _tools(prev_tools) != _tools(new_tools) or prev.temperature != call.temperature:
        return BreakCause.TEMPLATE_CHANGE
    if prev.finish_reason == "length":
        return BreakCause.TRUNCATION
    return BreakCause.RETOKENIZED


def _tools(tools: Any) -> str:
    return json.dumps(tools or [], sort_keys=True)


@dataclass
class MergeStats:
    """Merge statistics over many rollouts."""

    rollouts: int = 0
    multi_call_rollouts: int = 0
    merged_multi_call_rollouts: int = 0  # multi-call rollouts that became exactly one row
    calls: int = 0
    rows: int = 0
    breaks: Counter[str] = field(default_factory=Counter)

    def add(self, result: MergeResult) -> None:
        """Count one rollout's merge result."""
        self.rollouts += 1
        self.calls += result.n_calls
        self.rows += len(result.rows)
        if result.n_calls > 1:
            self.multi_call_rollouts += 1
            self.merged_multi_call_rollouts += int(len(result.rows) == 1)
        self.breaks.update(str(b) for b in result.breaks)

    @property
    def merge_rate(self) -> float | None:
        """Fraction of multi-call rollouts that merged into a single row (None if there were none)."""
        if self.multi_call_rollouts == 0:
            return None
        return self.merged_multi_call_rollouts / self.multi_call_rollouts

    @property
    def rows_per_rollout(self) -> float:
        """Mean number of rows per rollout."""
        return self.rows / self.rollouts if self.rollouts else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The statistics as a JSON-ready dict."""
        return {
            "rollouts": self.rollouts,
            "multi_call_rollouts": self.multi_call_rollouts,
            "calls": self.calls,
            "rows": self.rows,
            "merge_rate": self.merge_rate,
            "rows_per_rollout": self.rows_per_rollout,
            "breaks": dict(self.breaks),
        }
