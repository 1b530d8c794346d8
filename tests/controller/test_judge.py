"""Judges (`controller.judge`): the strict parsers, single scoring and group ranking against a scripted
judge model served over real HTTP on loopback, garbage answers as grader errors, and group grading
through the controller (real harness subprocesses, a real gateway on a real SQLite store)."""

from __future__ import annotations

import asyncio
import math
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.grader import GraderError, grade
from harnessrl.controller.group_grading import GroupGate
from harnessrl.controller.judge import Judge, JudgeError, JudgeSpec, digit_expectation, parse_score
from harnessrl.controller.judge_ranking import parse_ranking, rank_rewards
from harnessrl.controller.runner import AttemptResult
from harnessrl.gateway.app import GatewayConfig, create_app
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RewardIn, RolloutState, Task
from harnessrl.store import SQLiteStore
from tests.support.gateway import ThreadServer
from tests.support.scripted_judge import Script, ScriptedJudge, StartJudge, candidates, scripted_judges


@pytest.fixture
def judge_server() -> Iterator[StartJudge]:
    yield from scripted_judges()


def _result(tmp_path: Path, name: str, answer: str | None) -> AttemptResult:
    out = tmp_path / name
    out.mkdir()
    if answer is not None:
        (out / "answer.txt").write_text(answer)
    return AttemptResult(exit_code=0, timed_out=False, output_dir=out, stdout_tail="", stderr_tail="")


TASK = Task(task_id="t", input={"sentence": "the cat sat", "style": "pirate"})


def test_parsers_take_the_last_line_and_refuse_garbage() -> None:
    assert parse_score("thinking... SCORE: 3\nno wait\nSCORE: 7.5", 10) == 7.5
    assert parse_score("**Score:** 4", 10) == 4.0
    for bad in ["great answer!", "SCORE: 11", "SCORE: -1", ""]:
        with pytest.raises(JudgeError):
            parse_score(bad, 10)
    assert parse_ranking("RANKING: 2 > 3 > 1", 3) == [[1], [2], [0]]
    assert parse_ranking("ranking: 1, 2", 2) == [[0], [1]]
    assert parse_ranking("RANKING: 3 = 1 > 2", 3) == [[2, 0], [1]]  # a tie
    for bad in ["RANKING: 1 > 1 > 2", "RANKING: 1 > 2", "RANKING: 1 > 2 > 4", "RANKING: 1 = 2 = 1 > 3",
                "they are all good"]:  # fmt: skip
        with pytest.raises(ValueError):
            parse_ranking(bad, 3)
    assert rank_rewards([1, 2, 0]) == [0.0, 1.0, 0.5]  # candidate 2 best, 3 second, 1 last
    assert rank_rewards([3, 0, 2, 1]) == pytest.approx([2 / 3, 0.0, 1 / 3, 1.0])
    assert rank_rewards([0]) == [1.0]


def test_single_mode_scores_one_answer_and_records_the_call(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path
) -> None:
    server, url = judge_server(lambda body: "Fairly piratey.\nSCORE: 6")
    judge = Judge(JudgeSpec(base_url=url, model="judge-m", rubric="Sounds like a pirate.", scale=8))
    reward = judge(TASK, _result(tmp_path, "a", "Arr, the cat be sittin'"))
    assert reward.value == 6 / 8
    record = reward.details["judge"]
    assert (
        record["score"] == 6
        and record["answer"] == "Fairly piratey.\nSCORE: 6"
        and record["model"] == "judge-m"
    )
    (sent,) = server.requests
    assert sent["model"] == "judge-m" and sent["messages"] == record["prompt"]
    assert (
        "Sounds like a pirate." in sent["messages"][0]["content"]
        and "0 (worst) to 8" in sent["messages"][0]["content"]
    )
    assert (
        "Arr, the cat be sittin'" in sent["messages"][1]["content"]
        and "pirate" in sent["messages"][1]["content"]
    )
    no_answer = judge(TASK, _result(tmp_path, "b", None))  # a harness that wrote nothing is judged as such
    assert "(no answer)" in server.requests[-1]["messages"][1]["content"] and no_answer.value == 0.75


@pytest.mark.parametrize("reply", ["I refuse to grade.", "SCORE: 99", "", 500])
async def test_a_judge_that_fails_or_answers_garbage_is_a_grader_error(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path, reply: str | int
) -> None:
    _, url = judge_server(lambda body: reply)
    judge = Judge(JudgeSpec(base_url=url, model="m", rubric="r"))
    with pytest.raises(GraderError, match="judge"):
        await grade(judge, TASK, _result(tmp_path, "a", "x"))


async def test_an_unreachable_judge_is_a_grader_error(tmp_path: Path) -> None:
    judge = Judge(JudgeSpec(base_url="http://127.0.0.1:9/v1", model="m", rubric="r", timeout_s=5))
    with pytest.raises(GraderError, match="cannot be reached"):
        await grade(judge, TASK, _result(tmp_path, "a", "x"))


def _top(pairs: list[tuple[str, float]]) -> dict[str, Any]:
    """A chat choice's `logprobs` with one answer token whose alternatives are `pairs` (token, probability)."""
    top = [{"token": t, "logprob": math.log(p), "bytes": list(t.encode())} for t, p in pairs]
    return {"content": [{"token": pairs[0][0], "logprob": top[0]["logprob"], "top_logprobs": top}]}


def test_logprob_mode_rewards_the_expected_digit_and_records_the_call(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path
) -> None:
    # digits 7 (0.5), 3 (0.2), " 9" (0.1, a digit with the tokenizer's leading space); words are ignored
    pairs = [("7", 0.5), ("3", 0.2), ("The", 0.15), (" 9", 0.1), ("10", 0.05)]
    server, url = judge_server(lambda body: ("7", _top(pairs)))
    judge = Judge(JudgeSpec(base_url=url, model="judge-m", rubric="Sounds like a pirate.", mode="logprob"))
    reward = judge(TASK, _result(tmp_path, "a", "Arr, the cat be sittin'"))
    expected = (7 * 0.5 + 3 * 0.2 + 9 * 0.1) / 0.8  # renormalised over the digits: 6.25
    assert reward.value == pytest.approx(expected / 9)
    record = reward.details["judge"]
    assert record["mode"] == "logprob" and record["score"] == pytest.approx(6.25)
    assert record["digit_mass"] == pytest.approx(0.8) and record["digits"] == pytest.approx(
        {"3": 0.2, "7": 0.5, "9": 0.1}
    )
    (sent,) = server.requests
    assert sent["max_tokens"] == 1 and sent["logprobs"] is True and sent["top_logprobs"] == 20
    assert (
        "Sounds like a pirate." in sent["messages"][0]["content"]
        and "one digit" in sent["messages"][1]["content"]
    )
    assert (
        "Arr, the cat be sittin'" in sent["messages"][1]["content"] and sent["messages"] == record["prompt"]
    )
    assert digit_expectation([{"token": "0", "logprob": 0.0}])[0] == 0.0  # a certain 0 is reward 0


ALT = st.tuples(st.sampled_from([*"0123456789", " 4", "7 ", "10", "The", "x", "", "٣"]),
                st.floats(min_value=-30, max_value=0))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(ALT, min_size=1, max_size=20), st.randoms(use_true_random=False))
def test_digit_expectation_is_the_mean_digit_over_the_digits_only(
    alts: list[tuple[str, float]], rnd: Any
) -> None:
    top = [{"token": t, "logprob": lp} for t, lp in alts]
    weights = {d: sum(math.exp(lp) for t, lp in alts if t.strip() == d) for d in "0123456789"}
    mass = sum(weights.values())
    if mass == 0.0:  # no ASCII digit (an Arabic-Indic digit is not one): a JudgeError
        with pytest.raises(JudgeError, match="no digit"):
            digit_expectation(top)
        return
    expected, got_mass, probs = digit_expectation(top)
    assert 0.0 <= expected <= 9.0 and got_mass == pytest.approx(mass)
    assert expected == pytest.approx(sum(int(d) * w for d, w in weights.items()) / mass)
    assert set(probs) == {d for d, w in weights.items() if w > 0}
    rnd.shuffle(top)  # the order of the alternatives does not matter
    assert digit_expectation(top)[0] == pytest.approx(expected)


@pytest.mark.parametrize(
    "reply",
    [("Well", _top([("Well", 0.6), ("The", 0.3), ("ten", 0.1)])), "7", ("7", {"content": []}), 503],
    ids=["no-digit", "no-logprobs", "empty-logprobs", "http-503"],
)
async def test_logprob_mode_without_a_digit_or_logprobs_is_a_grader_error(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path, reply: Any
) -> None:
    _, url = judge_server(lambda body: reply)
    judge = Judge(JudgeSpec(base_url=url, model="m", rubric="r", mode="logprob"))
    with pytest.raises(GraderError, match="judge"):
        await grade(judge, TASK, _result(tmp_path, "a", "x"))


def rank_by_text(body: dict[str, Any]) -> str:
    """A judge that ranks the candidates by their text, alphabetically (best first)."""
    order = sorted(candidates(body), key=lambda m: m[1])
    return "Compared.\nRANKING: " + " > ".join(str(i) for i, _ in order)


def test_group_mode_ranks_the_answers_side_by_side(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path
) -> None:
    server, url = judge_server(rank_by_text)
    judge = Judge(JudgeSpec(base_url=url, model="m", rubric="r", mode="group"))
    results = [_result(tmp_path, n, text) for n, text in [("a", "bravo"), ("b", "alpha"), ("c", "charlie")]]
    rewards = judge.grade_group(TASK, results)
    assert [r.value for r in rewards] == [0.5, 1.0, 0.0]
    assert len(server.requests) == 1  # one judge call for the whole group
    first = rewards[0].details["judge"]
    (judged,) = first["judgments"]
    assert first["candidate"] == 1 and judged["ranking"] == "2 > 1 > 3"  # in candidates, the shuffle undone
    shown = [text for _, text in candidates(server.requests[0])]
    assert shown == [
        ["bravo", "alpha", "charlie"][c - 1] for c in judged["shown"]
    ]  # the order it was shown in


async def test_group_gate_grades_when_the_rest_of_the_group_has_left(tmp_path: Path) -> None:
    seen: list[int] = []

    class Counting:
        grades_groups = True

        def grade_group(self, task: Task, results: list[AttemptResult]) -> list[RewardIn]:
            seen.append(len(results))
            return [RewardIn(value=float(i)) for i in range(len(results))]

    gate = GroupGate(Counting())
    gate.expect("g", ["a", "b", "c"])
    first = asyncio.create_task(gate.verdict("g", "a", TASK, _result(tmp_path, "a", "1")))
    second = asyncio.create_task(gate.verdict("g", "b", TASK, _result(tmp_path, "b", "2")))
    await asyncio.sleep(0.05)
    assert not first.done() and seen == []  # still waiting for c
    gate.leave("g", "c")  # c failed before grading: it will not come
    assert [(await first).value, (await second).value] == [0.0, 1.0] and seen == [2]
    assert (await first).details["exit_code"] == 0


HARNESS = r"""
import os
open(os.path.join(os.environ["HARNESSRL_OUTPUT"], "answer.txt"), "w").write(os.environ["HARNESSRL_ROLLOUT_ID"])
"""


async def test_controller_grades_a_group_larger_than_its_concurrency(
    judge_server: Callable[[Script], tuple[ScriptedJudge, str]], tmp_path: Path
) -> None:
    server, url = judge_server(
        lambda body: rank_by_text(body) if "good" in body["messages"][1]["content"] else "no idea"
    )
    store = SQLiteStore(tmp_path / "store.sqlite")
    admin = "admin-" + secrets.token_hex(8)
    gateway = ThreadServer(
        create_app(GatewayConfig(admin_key=admin, upstream_url="http://127.0.0.1:9"), store)
    )
    judge = Judge(JudgeSpec(base_url=url, model="m", rubric="r", mode="group"))
    with gateway:
        client = ControlClient(gateway.url, admin)
        ctl = Controller(client, gateway.url, HarnessSpec([sys.executable, "-c", HARNESS], timeout_s=30), judge,
                         tmp_path / "run", concurrency=1, grader_retries=1)  # fmt: skip
        good = Task(task_id="good", input={"kind": "good"})
        bad = Task(task_id="bad", input={"kind": "bad"})
        try:
            outcomes = await ctl.run(
                [RolloutRequest(good, f"g{i}", group_id="G") for i in range(3)]
                + [RolloutRequest(bad, f"b{i}", group_id="B") for i in range(2)]
            )
        finally:
            await client.aclose()
    good_out, bad_out = outcomes[:3], outcomes[3:]
    assert all(o.state == RolloutState.SUCCEEDED for o in good_out)
    by_id = sorted(good_out, key=lambda o: o.rollout_id)  # the scripted judge prefers the smaller id
    assert [o.reward for o in by_id] == [1.0, 0.5, 0.0]
    stored = store.get_reward(by_id[0].rollout_id)
    assert stored is not None and stored.details["judge"]["judgments"][0]["ranking"]
    assert all(o.state == RolloutState.FAILED and o.failure == "grader" for o in bad_out)
    assert "RANKING" in (bad_out[0].error or "")
    judged = [len(candidates(r)) for r in server.requests]
    assert sorted(judged) == [2, 2, 3]  # one call for the good group, two (one retry) for the bad one
    store.close()
