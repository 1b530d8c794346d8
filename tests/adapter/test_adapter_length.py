"""Length limits and staleness filtering of rows, and the rule that every row of a rollout carries
that rollout's advantage whatever is cut or dropped."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.adapter import Row, apply_length_limit, build_batch, filter_stale, row_staleness, truncate_row
from harnessrl.schema import (
    Attempt,
    AttemptStatus,
    Call,
    CallStatus,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutState,
)


@st.composite
def rows_st(draw: st.DrawFn) -> Row:
    n = draw(st.integers(1, 60))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(3, 1000), min_size=n, max_size=n))
    lps = [-0.5 * m * (i + 1) for i, m in enumerate(mask)]
    return Row("r", tokens, mask, lps, temperature=1.0)


@settings(max_examples=300, deadline=None)
@given(rows_st(), st.integers(2, 70))
def test_truncation_keeps_a_prefix_and_never_trains_past_it(row: Row, max_tokens: int) -> None:
    cut = truncate_row(row, max_tokens)
    if cut is None:  # dropped exactly when the budget holds no trainable token
        assert len(row.tokens) > max_tokens and sum(row.loss_mask[:max_tokens]) == 0
        return
    n = min(len(row.tokens), max_tokens)
    assert cut.tokens == row.tokens[:n] and cut.loss_mask == row.loss_mask[:n]
    # each kept trainable token keeps the logprob recorded for it, after the same context
    assert cut.old_logprobs == row.old_logprobs[:n]
    assert cut is row or cut.n_trainable > 0


@settings(max_examples=100, deadline=None)
@given(st.lists(rows_st(), min_size=1, max_size=8), st.integers(2, 70))
def test_length_report_counts_what_was_cut(rows: list[Row], max_tokens: int) -> None:
    kept, report = apply_length_limit(rows, max_tokens)
    assert all(len(r.tokens) <= max_tokens for r in kept)
    assert len(kept) + report.dropped_rows == len(rows)
    assert report.truncated_tokens == sum(r.n_trainable for r in rows) - sum(r.n_trainable for r in kept)
    assert apply_length_limit(rows, None)[0] == rows


def test_staleness_is_measured_from_the_oldest_call() -> None:
    row = Row("r", [1, 2], [0, 1], [0, -1], 1.0, weight_versions=[3, 5, None])
    assert row_staleness(row, 5) == 2 and row_staleness(row, 3) == 0
    assert row_staleness(Row("r", [1], [0], [0], 1.0, weight_versions=[None]), 9) == 0
    rows = [Row(f"r{v}", [1, 2], [0, 1], [0, -1], 1.0, weight_versions=[v]) for v in (0, 1, 2, 2, 3)]
    kept, report = filter_stale(rows, 3, max_staleness=1)
    assert [r.rollout_id for r in kept] == ["r2", "r2", "r3"] and report.dropped_rows == 2
    assert report.as_dict() == {"0": 1, "1": 2, "2": 1, "3": 1}
    assert len(filter_stale(rows, 3, None)[0]) == 5


def _detail(rid: str, group: str, reward: float, versions: list[int], lengths: list[int]) -> RolloutDetail:
    """A graded rollout of calls that do not extend each other: one row per call."""
    calls = [
        Call(call_id=f"{rid}-{i}", rollout_id=rid, attempt=0, index=i, created_at=0.0, latency_s=0.0,
             status=CallStatus.OK, model="m", upstream="e", request={}, response={}, weight_version=v,
             prompt_ids=[1, 100 + i, 7, 8], completion_ids=[5] * n, completion_logprobs=[-0.1] * n)
        for i, (v, n) in enumerate(zip(versions, lengths, strict=True))
    ]  # fmt: skip
    ro = Rollout(rollout_id=rid, client_id=rid, task_id=group, group_id=group, state=RolloutState.SUCCEEDED,
                 created_at=0.0, updated_at=0.0, n_attempts=1)  # fmt: skip
    attempt = Attempt(rollout_id=rid, attempt=0, status=AttemptStatus.EXITED, started_at=0.0)
    return RolloutDetail(rollout=ro, attempts=[attempt], calls=calls,
                         reward=Reward(rollout_id=rid, value=reward, updated_at=0.0))  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([None, 6, 9, 40]), st.sampled_from([None, 0, 1]))
def test_rows_of_one_rollout_never_get_different_advantages(
    seed: int, max_tokens: int | None, max_staleness: int | None
) -> None:
    rnd = random.Random(seed)
    details = []
    for g in range(3):
        for k in range(rnd.randint(1, 4)):
            n = rnd.randint(1, 6)
            details.append(_detail(f"g{g}r{k}", f"g{g}", float(rnd.randint(0, 2)),
                                   [rnd.randint(0, 2) for _ in range(n)], [rnd.randint(1, 12) for _ in range(n)]))  # fmt: skip
    batch = build_batch(details, max_row_tokens=max_tokens, version=2, max_staleness=max_staleness)
    seen: dict[str, float] = {}
    for row, adv in zip(batch.rows, batch.advantages, strict=True):
        assert seen.setdefault(row.rollout_id, adv) == adv
        if max_tokens is not None:
            assert len(row.tokens) <= max_tokens
        if max_staleness is not None:
            assert row_staleness(row, 2) <= max_staleness
    full = build_batch(details)  # cutting and dropping rows never changes a rollout's advantage
    full_adv = dict(zip([r.rollout_id for r in full.rows], full.advantages, strict=True))
    assert all(full_adv[rid] == adv for rid, adv in seen.items())
    assert sum(batch.staleness.histogram.values()) == len(full.rows)


def test_calls_of_failed_attempts_are_kept_out_unless_asked_for() -> None:
    d = _detail("r1", "g", 1.0, [0, 0], [3, 4])
    calls = [d.calls[0].model_copy(update={"attempt": 0}), d.calls[1].model_copy(update={"attempt": 1})]
    attempts = [d.attempts[0], d.attempts[0].model_copy(update={"attempt": 1})]
    d = d.model_copy(update={"calls": calls, "attempts": attempts})
    other = _detail("r2", "g", 0.0, [0], [2])
    last_only = build_batch([d, other])
    assert [len(r.tokens) for r in last_only.rows if r.rollout_id == "r1"] == [4 + 4]  # attempt 1's call
    both = build_batch([d, other], include_failed_attempts=True)
    assert sorted(len(r.tokens) for r in both.rows if r.rollout_id == "r1") == [4 + 3, 4 + 4]
    adv = {r.rollout_id: a for r, a in zip(both.rows, both.advantages, strict=True)}
    assert adv["r1"] > 0 > adv["r2"]
