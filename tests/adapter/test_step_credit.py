"""Step credit (`adapter.step_credit`) against hand-computed cases, and the default left unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.adapter import (
    Credit,
    Estimator,
    ZeroVariance,
    build_batch,
    turn_terms,
)
from harnessrl.adapter.step_credit import Pairing, call_keys, step_credit
from harnessrl.schema import (
    Annotation,
    Attempt,
    AttemptStatus,
    Call,
    CallStatus,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutState,
    StepReward,
)

PROMPT = [11, 12, 13]  # the first call's prompt; each rollout then gets 2 completion tokens per call
OBS = [21, 22]  # a tool result between the two calls (loss mask 0)


def _call(rid: str, k: int, prompt: list[int], completion: list[int], tool_call_id: str) -> Call:
    answer = {"role": "assistant", "content": None,
              "tool_calls": [{"id": tool_call_id, "type": "function",
                              "function": {"name": "calc", "arguments": "{}"}}]}  # fmt: skip
    return Call(call_id=f"{rid}-c{k}", rollout_id=rid, attempt=0, index=k, created_at=0.0, latency_s=0.0,
                status=CallStatus.OK, model="m", upstream="u", request={}, prompt_ids=prompt,
                completion_ids=completion, completion_logprobs=[-0.5] * len(completion),
                chat={"messages": [], "tools": None, "answer": answer})  # fmt: skip


def detail(
    rid: str,
    reward: float,
    steps: list[StepReward] = (),  # type: ignore[assignment]
    annotations: list[dict[str, Any]] = (),  # type: ignore[assignment]
    allow_annotations: bool = False,
    group: str = "g",
) -> RolloutDetail:
    """A rollout of two calls that merge into one row: PROMPT c0 OBS c1."""
    base = 100 * (ord(rid[-1]) % 50)
    c0 = [base + 1, base + 2]
    c1 = [base + 3, base + 4]
    calls = [
        _call(rid, 0, PROMPT, c0, f"tc-{rid}-0"),
        _call(rid, 1, PROMPT + c0 + OBS, c1, f"tc-{rid}-1"),
    ]
    meta = {"allow_annotation_rewards": True} if allow_annotations else {}
    return RolloutDetail(
        rollout=Rollout(rollout_id=rid, client_id=rid, task_id="t", group_id=group, metadata=meta,
                        state=RolloutState.SUCCEEDED, created_at=0.0, updated_at=0.0),
        attempts=[Attempt(rollout_id=rid, attempt=0, status=AttemptStatus.EXITED, started_at=0.0)],
        calls=calls,
        reward=Reward(rollout_id=rid, value=reward, steps=list(steps), updated_at=0.0),
        annotations=[Annotation(rollout_id=rid, created_at=0.0, **a) for a in annotations],
    )  # fmt: skip


def token_advantages(batch: Any, rid: str) -> list[float]:
    (i,) = [i for i, r in enumerate(batch.rows) if r.rollout_id == rid]
    assert batch.token_advantages is not None
    return list(batch.token_advantages[i])


def test_hand_computed_group() -> None:
    """Dr.GRPO over rewards (1, 0, 0): A = (2/3, -1/3, -1/3). Step 0 has step rewards a=1, b=0 and
    c=0.5 (c's named by the tool call its first call made): b_0 = 0.5, terms (+0.5, -0.5, 0). Step 1 has
    one step reward (a's): nothing to compare it with, term 0."""
    details = [
        detail("a", 1.0, [StepReward(call=0, value=1.0), StepReward(call=1, value=1.0)]),
        detail("b", 0.0, [StepReward(call=0, value=0.0)]),
        detail("c", 0.0, [StepReward(tool_call_id="tc-c-0", value=0.5)]),
    ]
    batch = build_batch(details, estimator=Estimator.DR_GRPO, credit=Credit.STEP)
    assert len(batch.rows) == 3
    a, b, c = 2 / 3, -1 / 3, -1 / 3
    # PROMPT(3) c0(2) OBS(2) c1(2): prompt and observation tokens keep A_i (their loss mask is 0)
    assert token_advantages(batch, "a") == pytest.approx([a] * 3 + [a + 0.5] * 2 + [a] * 2 + [a] * 2)
    assert token_advantages(batch, "b") == pytest.approx([b] * 3 + [b - 0.5] * 2 + [b] * 2 + [b] * 2)
    assert token_advantages(batch, "c") == pytest.approx([c] * 9)
    assert batch.advantages == pytest.approx([a, b, c])  # the rollout-level part
    assert batch.steps.step_rewards == 4 and batch.steps.credited_calls == 2 and batch.steps.unmatched == 0


def test_step_coef_scales_only_the_turn_term() -> None:
    details = [
        detail("a", 1.0, [StepReward(call=1, value=2.0)]),
        detail("b", 0.0, [StepReward(call=1, value=-2.0)]),
    ]
    batch = build_batch(details, estimator=Estimator.DR_GRPO, credit=Credit.STEP, step_coef=0.25)
    # A = (0.5, -0.5); step 1: b_1 = 0, terms 0.25 * (2, -2) = (0.5, -0.5)
    assert token_advantages(batch, "a") == pytest.approx([0.5] * 7 + [1.0] * 2)
    assert token_advantages(batch, "b") == pytest.approx([-0.5] * 7 + [-1.0] * 2)


def test_grpo_rollout_part_is_unchanged_and_terms_add() -> None:
    """GRPO's A_i are exactly the rollout-only estimator's; two step rewards on one call add up."""
    details = [
        detail("a", 3.0, [StepReward(call=0, value=1.0), StepReward(tool_call_id="tc-a-0", value=1.0)]),
        detail("b", 1.0, [StepReward(call=0, value=0.0)]),
    ]
    rollout_only = build_batch(details)
    step = build_batch(details, credit=Credit.STEP)
    assert step.advantages == rollout_only.advantages
    (aa, ab) = rollout_only.advantages
    assert aa == pytest.approx(1.0, abs=1e-5) and ab == pytest.approx(-1.0, abs=1e-5)
    # step 0: s = (2, 0), b_0 = 1, terms (+1, -1)
    assert token_advantages(step, "a")[3:5] == pytest.approx([aa + 1.0] * 2)
    assert token_advantages(step, "b")[3:5] == pytest.approx([ab - 1.0] * 2)


def test_default_is_rollout_only_and_step_without_step_rewards_equals_it() -> None:
    details = [detail("a", 1.0, [StepReward(call=0, value=5.0)]), detail("b", 0.0)]
    default = build_batch(details)
    assert default.token_advantages is None  # step rewards stored, not used: the default is unchanged
    plain = build_batch([detail("a", 1.0), detail("b", 0.0)], credit=Credit.STEP)
    assert plain.token_advantages is not None
    for row, adv, toks in zip(plain.rows, plain.advantages, plain.token_advantages, strict=True):
        assert toks == [adv] * len(row.tokens)
    assert [r.tokens for r in plain.rows] == [r.tokens for r in default.rows]
    assert plain.weights == default.weights  # loss normalisation untouched


def test_annotations_are_data_unless_the_task_allows_them() -> None:
    notes = [{"call": 0, "value": 1.0, "label": "good"}]
    denied = [detail("a", 0.0, annotations=notes), detail("b", 0.0, annotations=[{"call": 0, "value": 0.0}])]
    batch = build_batch(denied, estimator=Estimator.DR_GRPO, credit=Credit.STEP)
    assert all(a == 0.0 for toks in batch.token_advantages or [] for a in toks)
    assert batch.steps.ignored_annotations == 2 and batch.steps.step_rewards == 0
    allowed = [
        detail("a", 0.0, annotations=notes, allow_annotations=True),
        detail("b", 0.0, annotations=[{"call": 0, "value": 0.0}], allow_annotations=True),
    ]
    batch = build_batch(allowed, estimator=Estimator.DR_GRPO, credit=Credit.STEP)
    assert token_advantages(batch, "a")[3:5] == pytest.approx([0.5, 0.5])
    assert token_advantages(batch, "b")[3:5] == pytest.approx([-0.5, -0.5])
    assert batch.steps.from_annotations == 2
    label_only = [detail("a", 0.0, annotations=[{"call": 1, "label": "retry"}], allow_annotations=True)]
    assert build_batch(label_only, credit=Credit.STEP).steps.step_rewards == 0


def test_equal_rewards_with_step_signal_is_not_a_zero_variance_group() -> None:
    details = [
        detail("a", 1.0, [StepReward(call=0, value=1.0)]),
        detail("b", 1.0, [StepReward(call=0, value=0.0)]),
    ]
    step = build_batch(
        details, estimator=Estimator.DR_GRPO, credit=Credit.STEP, zero_variance=ZeroVariance.DROP
    )
    assert step.zero_variance_groups == 0 and len(step.rows) == 2
    assert token_advantages(step, "a")[3:5] == pytest.approx([0.5, 0.5])
    assert [step.has_signal(i) for i in range(2)] == [True, True]
    rollout = build_batch(details, estimator=Estimator.DR_GRPO, zero_variance=ZeroVariance.DROP)
    assert rollout.zero_variance_groups == 1 and rollout.rows == []


def test_unmatched_targets_are_counted_and_ignored() -> None:
    details = [
        detail("a", 1.0, [StepReward(call=7, value=1.0), StepReward(tool_call_id="nope", value=1.0)]),
        detail("b", 0.0),
    ]
    batch = build_batch(details, estimator=Estimator.DR_GRPO, credit=Credit.STEP)
    assert batch.steps.unmatched == 2 and batch.steps.step_rewards == 0
    assert token_advantages(batch, "a") == pytest.approx([0.5] * 9)


def test_groups_are_separate_and_truncation_keeps_the_terms_left() -> None:
    details = [
        detail("a", 1.0, [StepReward(call=1, value=1.0)], group="g1"),
        detail("b", 0.0, [StepReward(call=1, value=0.0)], group="g1"),
        detail("c", 0.0, [StepReward(call=1, value=9.0)], group="g2"),  # alone at step 1 in its group
        detail("d", 1.0, group="g2"),
    ]
    batch = build_batch(details, estimator=Estimator.DR_GRPO, credit=Credit.STEP, max_row_tokens=8)
    # rows cut to 8 tokens: c1 keeps its first token
    assert token_advantages(batch, "a") == pytest.approx([0.5] * 7 + [1.0])
    assert token_advantages(batch, "b") == pytest.approx([-0.5] * 7 + [-1.0])
    assert token_advantages(batch, "c") == pytest.approx([-0.5] * 8)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 4), st.floats(-3, 3, allow_nan=False), max_size=5),
                min_size=1, max_size=6))  # fmt: skip
def test_turn_terms_sum_to_zero_at_every_step(per_rollout: list[dict[int, float]]) -> None:
    steps = {f"r{i}": s for i, s in enumerate(per_rollout)}
    terms = turn_terms(steps, {r: "g" for r in steps}, coef=1.0)
    for k in range(5):
        have = [r for r in steps if k in steps[r]]
        total = sum(terms[r].get(k, 0.0) for r in have)
        assert total == pytest.approx(0.0, abs=1e-9)
        if have:
            mean = sum(steps[r][k] for r in have) / len(have)
            for r in have:
                assert terms[r].get(k, 0.0) == pytest.approx(steps[r][k] - mean, abs=1e-9)


# --- pairing calls by what they are -----------------------------------------------------------------


def _agent(rid: str, asks: list[str], steps: list[StepReward], **reward_details: Any) -> RolloutDetail:
    """A rollout whose k-th call answers the user message asks[k] (a sub-task of a variable-length run)."""
    calls = []
    prompt: list[int] = [1, 2]
    for k, ask in enumerate(asks):
        completion = [100 * (ord(rid[-1]) % 50) + k]
        call = _call(rid, k, list(prompt), completion, f"tc-{rid}-{k}")
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": ask}]
        calls.append(call.model_copy(update={"chat": {**(call.chat or {}), "messages": messages}}))
        prompt += [*completion, 7]
    base = detail(rid, 0.0)
    reward = Reward(rollout_id=rid, value=0.0, steps=steps, details=reward_details, updated_at=0.0)
    return base.model_copy(update={"calls": calls, "reward": reward})


def test_calls_pair_by_their_prompt_not_their_index() -> None:
    """a does sub-task X once, then Y; b needs X twice, then Y. By position b's retry of X would be
    compared with a's Y; by prompt Y meets Y and b's second X, which a has no counterpart of, gets no term."""
    a = _agent("a", ["X", "Y"], [StepReward(call=0, value=1.0), StepReward(call=1, value=1.0)])
    b = _agent("b", ["X", "X", "Y"], [StepReward(call=k, value=0.0) for k in range(3)])
    groups = {"a": "g", "b": "g"}
    credit = step_credit([a, b], groups)
    terms = {rid: {c: s.term for c, s in spans.items()} for rid, spans in credit.spans.items()}
    assert terms == {"a": {"a-c0": 0.5, "a-c1": 0.5}, "b": {"b-c0": -0.5, "b-c2": -0.5}}
    assert credit.report.unpaired == 1 and credit.report.paired_by_step == 0
    old = step_credit([a, b], groups, pairing=Pairing.POSITION)  # the index pairing, for ablation
    assert {c: s.term for c, s in old.spans["b"].items()} == {"b-c0": -0.5, "b-c1": -0.5}  # X-retry vs a's Y


def test_the_harness_steps_win_over_prompts() -> None:
    """Every call shows the same user message; the harness says which calls made which step, by
    `calls_per_step` in the reward's details or by a `step` on an annotation (data, no value)."""
    a = _agent("a", ["go"] * 2, [StepReward(call=1, value=1.0)], calls_per_step=[1, 1])
    b = _agent("b", ["go"] * 3, [StepReward(call=2, value=0.0)], calls_per_step=[2, 1])
    c = _agent("c", ["go"] * 3, [StepReward(call=2, value=0.5)])
    c = c.model_copy(update={"annotations": [Annotation(rollout_id="c", created_at=0.0, call=k, details={"step": s})
                                             for k, s in enumerate([0, 0, 1])]})  # fmt: skip
    assert call_keys(b) == [("step", "0", 0), ("step", "0", 1), ("step", "1", 0)] == call_keys(c)
    credit = step_credit([a, b, c], {"a": "g", "b": "g", "c": "g"})
    assert credit.spans["a"]["a-c1"].term == pytest.approx(0.5) and credit.spans["b"][
        "b-c2"
    ].term == pytest.approx(-0.5)
    assert credit.spans["c"]["c-c2"].term == pytest.approx(0.0) and credit.report.paired_by_step == 8
    assert credit.report.unpaired == 0
