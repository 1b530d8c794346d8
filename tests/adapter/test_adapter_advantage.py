"""Advantages and loss weights against direct reference implementations of their formulas."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.adapter import (
    Estimator,
    LossMode,
    Row,
    ZeroVariance,
    build_batch,
    group_advantages,
    loss_weights,
    rollout_advantages,
    sample_level_advantages,
)
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

rewards_st = st.lists(st.floats(min_value=-5, max_value=5, allow_nan=False), min_size=1, max_size=12)


def ref_advantages(r: list[float], est: Estimator) -> np.ndarray:
    x = np.asarray(r, dtype=np.float64)
    if est == Estimator.GRPO:
        return (x - x.mean()) / (x.std(ddof=0) + 1e-6)
    if est == Estimator.DR_GRPO:
        return x - x.mean()
    n = len(x)  # RLOO: reward minus the mean of the others
    return np.array([x[i] - np.delete(x, i).mean() if n > 1 else 0.0 for i in range(n)])


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.sampled_from(list(Estimator)))
def test_group_advantages_match_reference(rewards: list[float], est: Estimator) -> None:
    np.testing.assert_allclose(
        group_advantages(rewards, est), ref_advantages(rewards, est), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("est", list(Estimator))
def test_zero_variance_group_has_zero_advantage(est: Estimator) -> None:
    assert group_advantages([0.7] * 5, est) == pytest.approx([0.0] * 5, abs=1e-12)


@st.composite
def batches(draw: st.DrawFn) -> tuple[dict[str, float], dict[str, str], dict[str, int], list[Row]]:
    n_groups = draw(st.integers(1, 4))
    rewards, groups, n_rows, rows = {}, {}, {}, []
    for g in range(n_groups):
        for k in range(draw(st.integers(1, 5))):
            rid = f"g{g}r{k}"
            rewards[rid] = draw(st.sampled_from([0.0, 0.5, 1.0]))
            groups[rid] = f"g{g}"
            n_rows[rid] = draw(st.integers(1, 4))
            for _ in range(n_rows[rid]):
                mask = draw(st.lists(st.integers(0, 1), min_size=1, max_size=10))
                rows.append(Row(rid, list(range(len(mask))), mask, [0.0] * len(mask), 1.0))
    return rewards, groups, n_rows, rows


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(list(Estimator)))
def test_rollout_level_statistics_count_each_rollout_once(b: tuple, est: Estimator) -> None:  # type: ignore[type-arg]
    rewards, groups, _, rows = b
    adv = rollout_advantages(rewards, groups, est)
    for g in set(groups.values()):
        rids = [r for r in rewards if groups[r] == g]
        np.testing.assert_allclose(
            [adv[r] for r in rids], ref_advantages([rewards[r] for r in rids], est), atol=1e-9
        )
    # every row of a rollout gets that rollout's single advantage
    per_row = [adv[r.rollout_id] for r in rows]
    for rid in rewards:
        assert len({a for a, r in zip(per_row, rows, strict=True) if r.rollout_id == rid}) <= 1


@settings(max_examples=150, deadline=None)
@given(batches())
def test_sample_level_ablation_counts_each_row(b: tuple) -> None:  # type: ignore[type-arg]
    rewards, groups, n_rows, _ = b
    adv = sample_level_advantages(rewards, groups, n_rows)
    for g in set(groups.values()):
        rids = [r for r in rewards if groups[r] == g]
        expanded = [rewards[r] for r in rids for _ in range(n_rows[r])]  # one entry per row
        ref = ref_advantages(expanded, Estimator.GRPO)
        i = 0
        for r in rids:
            assert adv[r] == pytest.approx(ref[i], abs=1e-9)
            i += n_rows[r]


def ref_loss(rows: list[Row], per_token: list[list[float]], mode: LossMode) -> float:
    """L computed straight from the formulas, without weights."""
    trainable = [(r, lt) for r, lt in zip(rows, per_token, strict=True) if sum(r.loss_mask)]
    if not trainable:
        return 0.0
    if mode == LossMode.TOKEN_MEAN:
        vals = [x for r, lt in trainable for x, m in zip(lt, r.loss_mask, strict=True) if m]
        return float(np.mean(vals))
    if mode == LossMode.SAMPLE_MEAN:
        return float(
            np.mean([np.mean([x for x, m in zip(lt, r.loss_mask, strict=True) if m]) for r, lt in trainable])
        )
    by_rollout: dict[str, list[float]] = {}
    for r, lt in trainable:
        by_rollout.setdefault(r.rollout_id, []).extend(x for x, m in zip(lt, r.loss_mask, strict=True) if m)
    return float(np.mean([np.mean(v) for v in by_rollout.values()]))


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(list(LossMode)), st.randoms(use_true_random=False))
def test_loss_weights_reproduce_the_reference_loss(b: tuple, mode: LossMode, rnd) -> None:  # type: ignore[no-untyped-def, type-arg]
    rows = b[3]
    per_token = [[rnd.uniform(-3, 3) for _ in r.tokens] for r in rows]
    w = loss_weights(rows, mode)
    weighted = sum(wi * x for ws, xs in zip(w, per_token, strict=True) for wi, x in zip(ws, xs, strict=True))
    assert weighted == pytest.approx(ref_loss(rows, per_token, mode), rel=1e-9, abs=1e-9)
    for ws, r in zip(w, rows, strict=True):
        assert all(wi == 0.0 for wi, m in zip(ws, r.loss_mask, strict=True) if m == 0)


def _detail(rid: str, group: str, reward: float, n_calls: int = 1) -> RolloutDetail:
    """A graded rollout whose calls do not extend each other (n_calls rows)."""
    calls = [
        Call(call_id=f"{rid}-{i}", rollout_id=rid, attempt=0, index=i, created_at=0.0, latency_s=0.0,
             status=CallStatus.OK, model="m", upstream="e", request={}, response={},
             prompt_ids=[1, 100 + i], completion_ids=[5, 6], completion_logprobs=[-0.1, -0.2])
        for i in range(n_calls)
    ]  # fmt: skip
    ro = Rollout(rollout_id=rid, client_id=rid, task_id=group, group_id=group, state=RolloutState.SUCCEEDED,
                 created_at=0.0, updated_at=0.0, n_attempts=1)  # fmt: skip
    attempt = Attempt(rollout_id=rid, attempt=0, status=AttemptStatus.EXITED, started_at=0.0)
    return RolloutDetail(rollout=ro, attempts=[attempt], calls=calls,
                         reward=Reward(rollout_id=rid, value=reward, updated_at=0.0))  # fmt: skip


def test_zero_variance_groups_are_counted_and_kept_or_dropped() -> None:
    details = [_detail("a1", "ga", 1.0), _detail("a2", "ga", 1.0, n_calls=2),  # all equal: zero variance
               _detail("b1", "gb", 1.0), _detail("b2", "gb", 0.0),
               _detail("c1", "gc", 0.0), _detail("c2", "gc", 0.0)]  # fmt: skip
    kept = build_batch(details, zero_variance=ZeroVariance.KEEP)
    dropped = build_batch(details, zero_variance=ZeroVariance.DROP)
    assert (kept.groups, kept.zero_variance_groups, kept.dropped_rows) == (3, 2, 0)
    assert (dropped.groups, dropped.zero_variance_groups, dropped.dropped_rows) == (3, 2, 5)
    assert len(kept.rows) == 7 and {r.rollout_id for r in dropped.rows} == {"b1", "b2"}
    by_rollout = dict(zip([r.rollout_id for r in kept.rows], kept.advantages, strict=False))
    assert by_rollout["a1"] == by_rollout["c2"] == 0.0
    # the surviving group's advantages do not depend on the choice
    assert (
        dropped.advantages == [by_rollout["b1"], by_rollout["b2"]] and by_rollout["b1"] > 0 > by_rollout["b2"]
    )


@pytest.mark.parametrize("estimator", list(Estimator))
@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, 0.0, 1.0, 123.456])
def test_equal_rewards_give_exact_zero_advantages(estimator: Estimator, value: float) -> None:
    # 0.7 * 3 / 3 rounds to 0.7000000000000001: a mean-based deviation is ~1e-10 under GRPO, not 0
    assert group_advantages([value] * 3, estimator) == [0.0, 0.0, 0.0]
    rewards = {f"r{i}": value for i in range(3)}
    groups = dict.fromkeys(rewards, "g")
    assert set(sample_level_advantages(rewards, groups, {"r0": 1, "r1": 2, "r2": 3}).values()) == {0.0}


def test_sample_level_is_rejected_with_another_estimator() -> None:
    from harnessrl.config import ConfigError, load_config

    load_config(None, ["train.advantage_level=sample", "train.estimator=grpo"])
    for estimator in ("dr_grpo", "rloo"):
        with pytest.raises(ConfigError, match="cannot be combined with estimator"):
            load_config(None, ["train.advantage_level=sample", f"train.estimator={estimator}"])
