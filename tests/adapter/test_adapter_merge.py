"""The merge rule, property-based over random call sequences with and without prefix breaks."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.adapter import BreakCause, MergeStats, classify_break, merge_calls
from harnessrl.schema import Call, CallStatus

tokens = st.lists(st.integers(min_value=3, max_value=500), min_size=1, max_size=12)


def make_call(i: int, prompt: list[int], completion: list[int], **kw: Any) -> Call:
    return Call(
        call_id=f"c{i}", rollout_id="r", attempt=0, index=i, created_at=0.0, latency_s=0.0,
        status=kw.pop("status", CallStatus.OK), model="m", upstream="u", request=kw.pop("request", {}),
        response=kw.pop("response", None), prompt_ids=prompt, completion_ids=completion,
        completion_logprobs=[-0.01 * (i + 1) - 0.001 * j for j in range(len(completion))], **kw,
    )  # fmt: skip


@st.composite
def conversations(draw: st.DrawFn, allow_breaks: bool) -> tuple[list[Call], int]:
    """A rollout's calls: each prompt extends the previous context, unless a break edits history."""
    context = draw(tokens)
    calls, n_breaks = [], 0
    for i in range(draw(st.integers(min_value=1, max_value=8))):
        if i and allow_breaks and draw(st.booleans()):
            pos = draw(st.integers(min_value=0, max_value=len(context) - 1))
            context = [*context[:pos], 1, *context[pos + 1 :]]  # token id 1 never occurs otherwise
            n_breaks += 1
        completion = draw(tokens)
        calls.append(make_call(i, list(context), completion))
        context = context + completion + draw(tokens)  # the observation (tool output, user turn)
    return calls, n_breaks


def check_invariants(calls: list[Call]) -> None:
    result = merge_calls(calls)
    by_id = {c.call_id: c for c in calls}
    placed = [cid for row in result.rows for cid in row.call_ids]
    assert sorted(placed) == sorted(by_id)  # every call in exactly one row
    for row in result.rows:
        assert len(row.tokens) == len(row.loss_mask) == len(row.old_logprobs)
        assert sum(row.loss_mask) == sum(len(by_id[c].completion_ids) for c in row.call_ids)
        for cid in row.call_ids:
            c = by_id[cid]
            p, n = len(c.prompt_ids), len(c.completion_ids)
            assert row.tokens[:p] == c.prompt_ids
            assert row.tokens[p : p + n] == c.completion_ids
            assert row.loss_mask[p : p + n] == [1] * n
            assert row.old_logprobs[p : p + n] == c.completion_logprobs
        # nothing the model did not sample is trained on
        assert all(lp == 0.0 for lp, m in zip(row.old_logprobs, row.loss_mask, strict=True) if m == 0)
    # reference: a call opens a new row iff its prompt extends none of the rows built before it
    rows: list[list[int]] = []
    for c in calls:
        ext = [r for r in rows if c.prompt_ids[: len(r)] == r]
        if ext:
            best = max(ext, key=len)
            best[:] = c.prompt_ids + c.completion_ids
        else:
            rows.append(c.prompt_ids + c.completion_ids)
    assert sorted(map(tuple, rows)) == sorted(tuple(r.tokens) for r in result.rows)
    assert len(result.breaks) == len(result.rows) - 1


@settings(max_examples=200, deadline=None)
@given(conversations(allow_breaks=False))
def test_unbroken_conversation_merges_into_one_row(conv: tuple[list[Call], int]) -> None:
    calls, _ = conv
    result = merge_calls(calls)
    assert len(result.rows) == 1 and result.breaks == []
    last = calls[-1]
    assert result.rows[0].tokens == last.prompt_ids + last.completion_ids
    check_invariants(calls)


@settings(max_examples=300, deadline=None)
@given(conversations(allow_breaks=True))
def test_broken_conversations_keep_every_call_exactly_once(conv: tuple[list[Call], int]) -> None:
    calls, n_breaks = conv
    check_invariants(calls)
    assert len(merge_calls(calls).rows) <= 1 + n_breaks


@settings(max_examples=100, deadline=None)
@given(conversations(allow_breaks=False))
def test_merge_off_makes_every_call_its_own_row(conv: tuple[list[Call], int]) -> None:
    calls, _ = conv
    result = merge_calls(calls, merge=False)
    assert [r.tokens for r in result.rows] == [c.prompt_ids + c.completion_ids for c in calls]
    assert result.breaks == [] and result.n_calls == len(calls)


def test_call_may_extend_an_earlier_open_row() -> None:
    """Sub-agent pattern: main thread, a side call, then the main thread continues."""
    main1 = make_call(0, [10, 11], [12])
    side = make_call(1, [20, 21], [22])
    main2 = make_call(2, [10, 11, 12, 13], [14])
    result = merge_calls([main1, side, main2])
    assert [r.call_ids for r in result.rows] == [["c0", "c2"], ["c1"]]


def test_failed_calls_and_missing_logprobs_are_left_out() -> None:
    ok = make_call(0, [5], [6])
    failed = make_call(1, [5, 6, 7], [8], status=CallStatus.FAILED)
    result = merge_calls([ok, failed])
    assert result.n_calls == 1 and result.rows[0].call_ids == ["c0"]


def _msgs(*contents: str) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]


def test_break_causes_are_classified_from_messages_and_tokens() -> None:
    answer = {"choices": [{"message": {"role": "assistant", "content": "a1"}}]}
    prev = make_call(0, [1, 2], [3], request={"messages": _msgs("q1")}, response=answer)
    extends = {"messages": _msgs("q1", "a1", "q2")}
    edited = {"messages": _msgs("q1-edited", "a1", "q2")}
    assert classify_break(prev, make_call(1, [9], [9], request=edited)) == BreakCause.HISTORY_EDITED
    assert classify_break(prev, make_call(1, [9], [9], request=extends)) == BreakCause.RETOKENIZED
    tools = {**extends, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert classify_break(prev, make_call(1, [9], [9], request=tools)) == BreakCause.TEMPLATE_CHANGE
    cut = make_call(
        0, [1, 2], [3], request={"messages": _msgs("q1")}, response=answer, finish_reason="length"
    )
    assert classify_break(cut, make_call(1, [9], [9], request=extends)) == BreakCause.TRUNCATION


def test_merge_stats_count_single_row_multi_call_rollouts() -> None:
    stats = MergeStats()
    stats.add(merge_calls([make_call(0, [1], [2]), make_call(1, [1, 2, 3], [4])]))
    stats.add(merge_calls([make_call(0, [1], [2]), make_call(1, [7], [4])]))
    stats.add(merge_calls([make_call(0, [1], [2])]))
    assert stats.multi_call_rollouts == 2 and stats.merge_rate == 0.5
    assert stats.rows == 4 and stats.as_dict()["breaks"] == {"retokenized": 1}


def test_calls_of_different_policies_never_share_a_row() -> None:
    """Several policies: a solver call that extends the planner's tokens still starts a row of its own
    (a row trains one adapter), recorded as a policy change; each row keeps its policy."""
    plan = make_call(0, [10, 11], [12], policy="planner")
    solve = make_call(1, [10, 11, 12, 13], [14], policy="solver")
    replan = make_call(2, [10, 11, 12, 15], [16], policy="planner")
    result = merge_calls([plan, solve, replan])
    assert [(r.call_ids, r.policy) for r in result.rows] == [
        (["c0", "c2"], "planner"),
        (["c1"], "solver"),
    ]
    assert result.breaks == [BreakCause.POLICY_CHANGE]
