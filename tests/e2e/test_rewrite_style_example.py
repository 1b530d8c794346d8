"""The `rewrite_style` example: its config resolves to a logprob judge with its rubric, its splits never
share a sentence, and one group runs end to end — the example's real harness (openai SDK, subprocesses)
through a real gateway and engine (tiny model), judged in group mode in one call by a scripted judge on
loopback HTTP that sees the four rewrites side by side; a real engine as the judge (a tiny random model,
which answers garbage) makes the group a grader error, not a silent reward, in group mode and in logprob
mode (whose error shows the engine's top_logprobs were read: no digit among them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harnessrl.controller import Controller, HarnessSpec, RolloutRequest
from harnessrl.controller.judge import Judge
from harnessrl.examples import get_example
from harnessrl.gateway.client import ControlClient
from harnessrl.schema import RolloutState
from harnessrl.services import Service
from tests.support.gateway import GatewayHandle, ThreadServer
from tests.support.scripted_judge import candidates


def test_config_resolves_to_a_logprob_judge_on_disjoint_splits() -> None:
    example = get_example("rewrite_style")
    assert isinstance(example.grader, Judge) and example.grader.spec.mode == "logprob"
    assert not example.grader.grades_groups  # one judge call per rollout
    assert (
        "keeps every fact" in example.grader.spec.rubric and example.grader.spec.answer_file == "answer.txt"
    )
    train, held = example.build_splits(40, 20, 0)
    assert len(train) == 40 and len(held) == 20 and not train[0].reference  # nothing to check against
    assert not {t.input["sentence"] for t in train} & {t.input["sentence"] for t in held}


@pytest.fixture
def ranking_judge() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A judge endpoint that ranks the candidates by length, shortest first; it keeps its requests."""
    seen: list[dict[str, Any]] = []

    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.append(body)
        order = sorted(candidates(body), key=lambda m: (len(m[1]), m[0]))
        text = "RANKING: " + " > ".join(str(i) for i, _ in order)
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    with ThreadServer(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])) as srv:
        yield f"{srv.url}/v1", seen


async def _run_group(gw: GatewayHandle, judge: Judge, tmp_path: Path) -> list[Any]:
    example = get_example("rewrite_style")
    train, _ = example.build_splits(1, 0, 0)
    client = ControlClient(gw.url, gw.admin_key)
    ctl = Controller(client, gw.url, HarnessSpec(example.harness_command, timeout_s=120), judge,
                     tmp_path / "run", concurrency=2)  # fmt: skip
    try:
        return await ctl.run([RolloutRequest(train[0], f"c{k}", group_id="G") for k in range(4)])
    finally:
        await client.aclose()


async def test_one_group_is_rewritten_and_ranked_by_the_judge(
    make_gateway: Callable[..., GatewayHandle],
    ranking_judge: tuple[str, list[dict[str, Any]]],
    tmp_path: Path,
) -> None:
    url, seen = ranking_judge
    judge = get_example("rewrite_style").grader
    assert isinstance(judge, Judge)
    judge = Judge(dataclasses.replace(judge.spec, base_url=url, mode="group"))
    gw = make_gateway(default_max_tokens=12)
    outcomes = await _run_group(gw, judge, tmp_path)
    assert all(o.state == RolloutState.SUCCEEDED for o in outcomes), [o.error for o in outcomes]
    assert sorted(o.reward for o in outcomes) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert len(seen) == 1  # one judge call for the group
    prompt = seen[0]["messages"][1]["content"]
    for o in outcomes:
        answer = (tmp_path / "run/rollouts" / o.rollout_id / "attempt-0/output/answer.txt").read_text()
        (call,) = gw.store.calls(o.rollout_id)  # the rewrite the judge saw is the one the model sampled
        sampled = (call.response or {})["choices"][0]["message"]["content"]
        assert answer.split() == sampled.split()
        assert f"\n{answer or '(no answer)'}" in prompt
        judged = gw.store.get_reward(o.rollout_id)
        assert judged is not None and judged.details["judge"]["ranking"]


async def test_a_real_engine_answering_garbage_is_a_grader_error(
    make_gateway: Callable[..., GatewayHandle], engine: Service, tmp_path: Path
) -> None:
    judge = get_example("rewrite_style").grader
    assert isinstance(judge, Judge)
    spec = dataclasses.replace(judge.spec, base_url=f"{engine.url}/v1", model="judge", max_tokens=8)
    outcomes = await _run_group(make_gateway(default_max_tokens=8), Judge(dataclasses.replace(spec, mode="group")),
                                tmp_path / "group")  # fmt: skip
    assert all(o.state == RolloutState.FAILED and o.failure == "grader" for o in outcomes)
    error = outcomes[0].error or ""  # a random model's answer: no ranking line, or nothing at all
    assert "JudgeError" in error and ("RANKING" in error or "answered nothing" in error)
    # logprob mode reads the engine's top_logprobs (the wire shape matches); a random model over a 49k
    # vocabulary puts no digit among its 20 most likely answer tokens: a grader error naming that
    outcomes = await _run_group(make_gateway(default_max_tokens=8), Judge(spec), tmp_path / "logprob")
    assert all(o.state == RolloutState.FAILED and o.failure == "grader" for o in outcomes)
    assert "no digit 0-9 among the judge's 20 most likely answer tokens" in (outcomes[0].error or "")
